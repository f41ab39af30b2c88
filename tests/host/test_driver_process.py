"""host.driver_process: the one way a driver process is stopped and its output quoted, on real
child processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from host.driver_process import driver_argv, output_tail, stop_process


def _python(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def _ready(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"  # its signal handlers are in place


def test_a_clean_exit_within_the_grace_is_not_signalled() -> None:
    with _python("import sys, time; print('ready', flush=True); time.sleep(0.3); sys.exit(7)") as proc:
        _ready(proc)
        stop_process(proc, exit_grace_s=10.0)
    assert proc.returncode == 7  # exited on its own: no SIGTERM


def test_a_driver_that_ignores_sigterm_is_killed() -> None:
    with _python(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    ) as proc:
        _ready(proc)
        stop_process(proc, exit_grace_s=0.0, terminate_s=0.2)
    assert proc.returncode == -signal.SIGKILL


def test_a_running_driver_gets_sigterm_first() -> None:
    with _python("import time; print('ready', flush=True); time.sleep(60)") as proc:
        _ready(proc)
        stop_process(proc)
    assert proc.returncode == -signal.SIGTERM


def test_stopping_a_reaped_process_is_a_no_op() -> None:
    with _python("pass") as proc:
        proc.wait()
        stop_process(proc)
    assert proc.returncode == 0


def test_output_tail_quotes_the_end_of_the_log(tmp_path: Path) -> None:
    log = tmp_path / "driver.log"
    log.write_bytes(b"x" * 5000 + b"\nTraceback: vocab mismatch\n")
    tail = output_tail(log, 100)
    assert tail.endswith("Traceback: vocab mismatch") and len(tail) <= 100
    assert output_tail(tmp_path / "missing.log") == "(no driver output)"
    (tmp_path / "empty.log").write_bytes(b"")
    assert output_tail(tmp_path / "empty.log") == "(no driver output)"


def test_driver_argv_runs_this_interpreter() -> None:
    argv = driver_argv("drivers.dummy", "unix:/tmp/d.sock", ["--vocab-size", "64"])
    assert argv == [sys.executable, "-m", "drivers.dummy", "--listen", "unix:/tmp/d.sock", "--vocab-size", "64"]
