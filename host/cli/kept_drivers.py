"""Kept drivers: a driver process started once (`wafer driver start torch`) that later `wafer run`s
on this machine connect to instead of starting their own, so a run skips the model load.

A kept driver listens on a Unix socket in the cache directory (`drivers/NAME.sock`) and is
described by `drivers/NAME.json` (pid, address, arguments); its output goes to `drivers/NAME.log`.
The folder and its files are the user's alone (0700 and 0600). The driver serves one host
connection at a time and refuses others meanwhile (`drivers.host_slot`); each host says `Hello`
afresh, so runs do not see each other's contexts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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
    os.chmod(folder, 0o700)  # whatever the umask was, or made it, before
    sock = folder / f"{name}.sock"  # 0600: made so by the driver when it binds
    log_path = folder / f"{name}.log"
    address = f"unix:{sock}"
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    with _interruptible():
        pid = _spawn(driver_argv(module, address, args), log_path)
        try:
            progress(f"starting the {name} driver (pid {pid}; its output goes to {log_path})")
            exit_code = _wait_until_listening(name, pid, sock, log_path, timeout_s)
            if exit_code is None:
                kept = KeptDriver(name, pid, address, tuple(args), str(log_path), time.time())
                _write_record(cache_dir, kept)
        except BaseException:
            # Interrupted or failed: a driver in a session of its own that no record names would
            # hold its memory (a torch driver's, gigabytes) unseen until someone found its pid.
            _kill(pid)
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()
            raise
    if exit_code is not None:  # here, not in the try: it is reaped, and its pid no longer its to kill
        tail = output_tail(log_path)
        raise DriverFailed(f"the {name} driver exited with status {exit_code} before listening:\n{tail}")
    return kept


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM and SIGHUP (the terminal closed) interrupt `start` as Ctrl-C does, so that its
    cleanup runs instead of the process just ending. In the main thread only: Python runs signal
    handlers there, and a start in another thread is its caller's to interrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} while starting a driver")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _spawn(argv: list[str], log_path: Path) -> int:
    """Start `argv` in a session of its own, its output to `log_path` (0600), and return its pid.
    posix_spawn, not Popen: the driver outlives this process, and no Popen object is left to
    complain that its child still runs."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(log_fd, 0o600)  # a log kept from an earlier start keeps its old mode otherwise
        return os.posix_spawn(
            sys.executable,
            argv,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
            ],
            setsid=True,
        )
    finally:
        os.close(log_fd)


def _wait_until_listening(name: str, pid: int, sock: Path, log_path: Path, timeout_s: float) -> int | None:
    """None once the driver `pid` accepts connections on `sock`; its exit code (it is reaped) if
    it exits first. `DriverFailed` once `timeout_s` has passed (it still runs)."""
    deadline = time.monotonic() + timeout_s
    while not (sock.exists() and accepts(str(sock))):
        exited, status = os.waitpid(pid, os.WNOHANG)
        if exited == pid:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            raise DriverFailed(f"the {name} driver did not listen within {timeout_s:g} s (see {log_path})")
        time.sleep(_POLL_S)
    return None


def _kill(pid: int) -> None:
    """SIGKILL the driver `start` spawned and has not reaped (so `pid` is still its), with
    whatever it started in its session (its process group), and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _write_record(cache_dir: Path, kept: KeptDriver) -> None:
    """Write the record whole or not at all: a temporary file of its own (0600, a unique name, so
    two starts never write one file), then renamed over the record."""
    path = _record_path(cache_dir, kept.name)
    fd, tmp = tempfile.mkstemp(prefix=f".{kept.name}.", suffix=".json.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(asdict(kept)))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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
