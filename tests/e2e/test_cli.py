"""The `wafer` command line: build errors point at file and line; `run` streams and reports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from host.cli.commands import EXIT_FAILED, EXIT_OK, main


def _write_inferlet(root: Path, source: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "app.py").write_text(source)
    return root


def test_build_reports_a_syntax_error_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _write_inferlet(tmp_path / "broken", 'from inferlet import emit\n\ndef main(args):\n    emit("x"\n')
    assert main(["--cache-dir", str(tmp_path / "cache"), "build", str(folder)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{folder / 'app.py'}:4" in err
    assert "SyntaxError" in err


def test_an_import_time_error_is_reported_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On wafer's base the inferlet's modules are imported when the run starts: the run reports
    the error with the inferlet's own file and line. A snapshot build imports them at build time
    and reports it there, building nothing."""
    source = "from inferlet import emit\n\n\nvalue = undefined_name + 1\n\n\ndef main(args):\n    pass\n"
    folder = _write_inferlet(tmp_path / "broken_import", source)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main([*cache, "build", "--no-compile", str(folder)]) == EXIT_OK
    capsys.readouterr()
    assert main([*cache, "run", str(folder), "--no-stdin"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f'File "{folder / "app.py"}", line 4, in <module>' in err
    assert "NameError: name 'undefined_name' is not defined" in err
    _frames_exist(err)
    on_base = set((tmp_path / "cache" / "build").glob("*.wasm"))
    assert main([*cache, "build", "--snapshot", str(folder)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{folder / 'app.py'}:4: NameError: name 'undefined_name' is not defined" in err
    assert set((tmp_path / "cache" / "build").glob("*.wasm")) == on_base  # the failed build left nothing


def test_build_without_an_app_module_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["--cache-dir", str(tmp_path), "build", str(tmp_path / "empty")]) == EXIT_FAILED
    assert "app.py" in capsys.readouterr().err


def test_run_streams_the_completion(
    built: dict[str, Path], cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--cache-dir", str(cache_dir), "run", "text_completion", "--", "--prompt", "Hi", "--max-tokens", "4"]
    assert main(argv) == EXIT_OK
    assert capsys.readouterr().out.endswith("\n")


def test_the_first_grammar_says_the_engines_load(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A first-use cost the user waits on is on the terminal: the grammar engines' load, once."""
    argv = ["--cache-dir", str(cache_dir), "run", "json_decoding", "--no-stdin", "--"]
    assert main([*argv, "--schema", '{"type": "object"}', "--max-tokens", "8"]) == EXIT_OK
    err = capsys.readouterr().err
    assert err.count("loading the grammar engines") == 1 and "grammar engines ready in" in err, err


def test_run_reports_the_inferlets_error(
    built: dict[str, Path], cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--cache-dir", str(cache_dir), "run", "text_completion", "--driver", "loopback", "--", "--max-tokens", "4"]
    assert main(argv) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "guest_error" in err
    assert "--prompt" in err


def test_run_on_replicas_and_a_bad_driver_among_them(
    built: dict[str, Path], cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["--cache-dir", str(cache_dir), "run", "text_completion"]
    tail = ["--", "--prompt", "Hi", "--max-tokens", "4"]
    assert main([*run, "--driver", "dummy", "--driver", "loopback", *tail]) == EXIT_OK
    assert capsys.readouterr().out.endswith("\n")
    assert main([*run, "--driver", "dummy", "--driver", "nonsense", *tail]) == EXIT_FAILED
    assert "unknown driver 'nonsense'" in capsys.readouterr().err
    # A built-in replica's own arguments reach its process (and only its process).
    assert main([*run, "--driver", "dummy --num-pages 64", "--driver", "dummy", *tail]) == EXIT_OK
    capsys.readouterr()
    assert main([*run, "--driver", "dummy", "--driver", "dummy --no-such-option", *tail]) == EXIT_FAILED
    assert "--no-such-option" in capsys.readouterr().err
    assert main([*run, "--driver", "tcp:127.0.0.1:9 --device cuda", *tail]) == EXIT_FAILED
    assert "only a built-in driver" in capsys.readouterr().err


ECHO = Path(__file__).resolve().parents[1] / "host" / "daemon" / "inferlets" / "echo"


def test_run_feeds_stdin_lines_to_receive_and_shows_sent_messages() -> None:
    """Each stdin line is a message `receive()` returns; end of input closes the client side
    (receive() then returns None); each `send()` is printed to stderr, marked."""
    done = subprocess.run(
        [sys.executable, "-m", "host.cli", "run", str(ECHO), "--", "echo"],
        input="hello\nwide world\n",
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stdout == "echo: hello\necho: wide world\n"
    assert 'wafer: send: {"received": 2}' in done.stderr
    closed = subprocess.run(  # no input at all: receive() sees the close at once
        [sys.executable, "-m", "host.cli", "run", str(ECHO), "--timeout-s", "60", "--", "echo"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert closed.returncode == EXIT_OK and 'wafer: send: {"received": 0}' in closed.stderr


def test_a_run_timed_out_in_receive_exits_1_every_time() -> None:
    """[limits] F8: 3 of 7 such runs aborted with SIGABRT (134) at e789649."""
    for _ in range(4):
        done = subprocess.run(
            [sys.executable, "-m", "host.cli", "run", str(ECHO), "--no-stdin", "--timeout-s", "1", "--", "echo"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == EXIT_FAILED and "wall-clock budget of 1 s exhausted" in done.stderr, done.stderr
        assert "cannot unwind" not in done.stderr


def test_a_host_call_at_import_works_on_the_base_and_is_named_in_a_snapshot_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the base, the module is imported in the run, where the host answers. In a snapshot
    build componentize-py's own words were a bare "AssertionError: Caused by:"."""
    source = "from inferlet import emit, model_info\n\nINFO = model_info()\n\n\ndef main(args):\n    emit(INFO.name)\n"
    folder = _write_inferlet(tmp_path / "calls_at_import", source)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main([*cache, "run", str(folder), "--no-stdin"]) == EXIT_OK
    assert capsys.readouterr().out == "dummy\n"
    assert main([*cache, "build", "--snapshot", str(folder)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "called the host (wafer:inferlet/model#info) while it was being built: no host calls at import" in err


def _frames_exist(error: str) -> None:
    """Every file a traceback names is a real file, but the guest's standard library (/python)
    and frozen or generated code: guest paths were mapped back to the inferlet's and the SDK's."""
    files = re.findall(r'File "([^"]+)", line', error)
    assert files
    assert all(Path(f).is_file() for f in files if not f.startswith(("<", "/python/"))), files


def _start_dev(folder: Path, *args: str) -> subprocess.Popen[str]:
    """`wafer dev FOLDER ARGS...` in a process of its own, its output piped as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "host.cli", "dev", str(folder), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_dev_reruns_the_inferlet_after_each_change(tmp_path: Path) -> None:
    source = "from inferlet import emit\n\n\ndef main(args):\n    emit('first ' + ' '.join(args) + '\\n')\n"
    folder = _write_inferlet(tmp_path / "dev_me", source)
    proc = _start_dev(folder, "--", "x", "y")
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "first x y\n"
        (folder / "app.py").write_text(source.replace("'first '", "'second '"))
        assert proc.stdout.readline() == "second x y\n"  # rebuilt and run again, same engine
        (folder / "app.py").write_text(source.replace("'first '", "missing + 'third '"))
    finally:
        time.sleep(2)  # the broken edit's run reports its error
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("changed: rebuilding and running") == 2
    assert "NameError: name 'missing' is not defined" in err
    _frames_exist(err[err.index("Traceback") :])


def _children(pid: int, marker: str) -> list[int]:
    """Processes whose parent is `pid` and whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == pid and marker in cmdline:
            found.append(int(entry.name))
    return found


def test_dev_restarts_a_driver_lost_between_runs(tmp_path: Path) -> None:
    source = "from inferlet import Context, emit\n\n\ndef main(args):\n    Context().fill('hi')\n    emit('first\\n')\n"
    folder = _write_inferlet(tmp_path / "dev_restart", source)
    proc = _start_dev(folder, "--driver", "dummy", "--driver", "dummy")
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "first\n"
        drivers = _children(proc.pid, "drivers.dummy")
        assert len(drivers) == 2
        os.kill(drivers[0], signal.SIGKILL)
        (folder / "app.py").write_text(source.replace("'first", "'second"))
        assert proc.stdout.readline() == "second\n"
        assert len(_children(proc.pid, "drivers.dummy")) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert re.search(r"wafer: replica \d \(dummy\) was lost \(.+\): restarting it", err), err
    assert re.search(r"wafer: replica \d \(dummy\) restarted", err), err
