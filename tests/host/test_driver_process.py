"""host.driver_process: the one way a driver process is stopped and its output quoted, on real
child processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bridge_schema.transport import HOST_PID_ENV
from host.driver_process import driver_argv, output_tail, owned_driver_env, stop_process


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


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; whoever inherited it reaps it when it will


def _exits(pid: int, within_s: float = 20.0) -> bool:
    """Whether `pid` exits within `within_s` (killed if it does not, so no test leaves it behind)."""
    deadline = time.monotonic() + within_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _running(pid):
        return True
    os.kill(pid, signal.SIGKILL)
    return False


def test_a_driver_exits_when_the_host_that_owns_it_is_killed() -> None:
    # A host killed with SIGKILL cannot stop its driver; the driver sees its parent gone and exits.
    host = _python(
        "import time; from host.engine import Engine, EngineConfig\n"
        "engine = Engine.start(EngineConfig('dummy'))\n"
        "print('ready', flush=True); time.sleep(120)"
    )
    with host:
        _ready(host)
        (driver,) = _children(host.pid)
        assert _running(driver)
        host.kill()
        host.wait()
        assert _exits(driver), "the driver outlived the host that started it"


def test_an_owned_drivers_environment_names_its_host() -> None:
    assert owned_driver_env()[HOST_PID_ENV] == str(os.getpid())


def test_the_daemons_driver_exits_when_the_daemon_is_killed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = subprocess.Popen(
        [sys.executable, "-m", "host.daemon", "--driver", "dummy", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with daemon:
        deadline = time.monotonic() + 60
        drivers: list[int] = []
        while not drivers and time.monotonic() < deadline and daemon.poll() is None:
            drivers = [c for c in _children(daemon.pid) if b"drivers.dummy" in Path(f"/proc/{c}/cmdline").read_bytes()]
            time.sleep(0.05)
        assert drivers, "the daemon started no driver"
        daemon.kill()
        daemon.wait()
        assert _exits(drivers[0]), "the driver outlived the daemon that started it"
