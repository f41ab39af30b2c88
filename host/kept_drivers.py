"""Kept drivers: a driver process started once (`wafer driver start torch`) that later `wafer run`s
on this machine connect to instead of starting their own, so a run skips the model load.

A kept driver listens on a Unix socket in the cache directory (`drivers/NAME.sock`) and is
described by `drivers/NAME.json` (pid, address, arguments); its output goes to `drivers/NAME.log`.
The driver serves one host connection after another (its serve loop keeps listening), and each
host says `Hello` afresh, so runs do not see each other's contexts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from host.driver_process import driver_argv, output_tail
from host.errors import DriverFailed

_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class KeptDriver:
    name: str
    pid: int
    address: str  # unix:PATH
    args: tuple[str, ...]
    log_path: str
    started_at: float


def _dir(cache_dir: Path) -> Path:
    return cache_dir / "drivers"


def _record_path(cache_dir: Path, name: str) -> Path:
    return _dir(cache_dir) / f"{name}.json"


def _is_alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child that exited: reaped now
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def accepts(path: str) -> bool:
    """Whether a server listens on the Unix socket `path` (its file exists a moment before)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _forget(cache_dir: Path, name: str) -> None:
    for suffix in (".json", ".sock"):
        with contextlib.suppress(FileNotFoundError):
            (_dir(cache_dir) / f"{name}{suffix}").unlink()


def find(cache_dir: Path, name: str) -> KeptDriver | None:
    """The kept driver `name`, if one is running (a record of one that died is removed)."""
    try:
        record = json.loads(_record_path(cache_dir, name).read_text())
        kept = KeptDriver(**{**record, "args": tuple(record["args"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not _is_alive(kept.pid):
        _forget(cache_dir, name)
        return None
    return kept


def list_kept(cache_dir: Path) -> list[KeptDriver]:
    folder = _dir(cache_dir)
    names = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
    return [kept for name in names if (kept := find(cache_dir, name)) is not None]


def start(
    cache_dir: Path,
    name: str,
    module: str,
    args: Sequence[str] = (),
    progress: Callable[[str], None] = lambda _msg: None,
    timeout_s: float = 600.0,
) -> KeptDriver:
    """Start `python -m MODULE --listen unix:...` in its own session (it outlives this process)
    and wait until it accepts connections. Refused if `name` is already kept."""
    running = find(cache_dir, name)
    if running is not None:
        raise DriverFailed(f"a {name} driver is already kept (pid {running.pid}); `wafer driver stop {name}` first")
    folder = _dir(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    sock = folder / f"{name}.sock"
    log_path = folder / f"{name}.log"
    address = f"unix:{sock}"
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    argv = driver_argv(module, address, args)
    # posix_spawn, not Popen: the driver outlives this process, in a session of its own, and no
    # Popen object is left to complain that its child still runs.
    pid = os.posix_spawn(
        sys.executable,
        argv,
        os.environ,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ],
        setsid=True,
    )
    progress(f"starting the {name} driver (pid {pid}; its output goes to {log_path})")
    deadline = time.monotonic() + timeout_s
    while not (sock.exists() and accepts(str(sock))):
        exited, status = os.waitpid(pid, os.WNOHANG)
        if exited == pid:
            tail = output_tail(log_path)
            code = os.waitstatus_to_exitcode(status)
            raise DriverFailed(f"the {name} driver exited with status {code} before listening:\n{tail}")
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise DriverFailed(f"the {name} driver did not listen within {timeout_s:g} s (see {log_path})")
        time.sleep(_POLL_S)
    kept = KeptDriver(name, pid, address, tuple(args), str(log_path), time.time())
    tmp = _record_path(cache_dir, name).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(kept)))
    os.replace(tmp, _record_path(cache_dir, name))
    return kept


def stop(cache_dir: Path, name: str, timeout_s: float = 10.0) -> KeptDriver | None:
    """Stop the kept driver `name` (SIGTERM: it shuts down cleanly; SIGKILL after `timeout_s`).
    Returns what was stopped, or None if none was kept."""
    kept = find(cache_dir, name)
    if kept is None:
        return None
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(kept.pid, sig)
        deadline = time.monotonic() + wait_s
        while _is_alive(kept.pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if not _is_alive(kept.pid):
            break
    _forget(cache_dir, name)
    return kept
