"""`host.cli.kept_drivers`: a kept driver's folder, socket, log and record are the user's alone
whatever the umask, and a start interrupted while it waits for the driver leaves none behind."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from host.cli import kept_drivers

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def cache(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kept_drivers.stop(tmp_path, "dummy")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_are_the_owners_alone_whatever_the_umask(cache: Path) -> None:
    folder = cache / "drivers"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    (folder / "dummy.log").touch(mode=0o666)  # left by an earlier start
    os.chmod(folder / "dummy.log", 0o666)
    previous = os.umask(0)  # the driver process inherits it
    try:
        kept = kept_drivers.start(cache, "dummy", "drivers.dummy")
    finally:
        os.umask(previous)
    assert _mode(folder) == 0o700
    assert _mode(Path(kept.address.removeprefix("unix:"))) == 0o600
    assert _mode(Path(kept.log_path)) == 0o600
    assert _mode(folder / "dummy.json") == 0o600
    assert sorted(p.name for p in folder.iterdir()) == ["dummy.json", "dummy.log", "dummy.sock"]  # no temporary left


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_start_leaves_no_driver(cache: Path, sig: signal.Signals) -> None:
    """Ctrl-C (or SIGTERM) while `wafer driver start torch` waits for the driver (loading its
    model for seconds): the driver it spawned, in a session of its own, goes too."""
    cli = subprocess.Popen(
        [sys.executable, "-m", "host.cli", "--cache-dir", str(cache), "driver", "start", "torch"],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert cli.stderr is not None
    line = ""
    while "starting the torch driver (pid " not in line:
        line = cli.stderr.readline()
        assert line, "the start ended before it spawned the driver"
    pid = int(line.split("(pid ")[1].split(";")[0])
    try:
        cli.send_signal(sig)
        assert cli.wait(timeout=30) == 130
        deadline = time.monotonic() + 10
        while _exists(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _exists(pid), f"the driver (pid {pid}) outlived the interrupted start"
        assert kept_drivers.find(cache, "torch") is None
        assert not (cache / "drivers" / "torch.sock").exists()
    finally:
        if _exists(pid):
            os.kill(pid, signal.SIGKILL)
        cli.stderr.close()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
