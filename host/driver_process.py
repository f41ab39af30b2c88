"""A driver as a child process: its command line, the tail of its output, and how it is stopped.

One copy for the three places that start a driver: `wafer run`'s link (`driver_link.py`), the
daemon's supervisor and `wafer driver start` (`kept_drivers.py`). Each waits for the driver's
socket in its own way (async, on a thread, or for a process it does not own), so that stays there.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

from bridge_schema.transport import HOST_PID_ENV


class DriverEntryError(ValueError):
    """A driver entry that cannot be read (see `split_driver`)."""


def split_driver(entry: str, builtin: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """A driver entry as (driver, its own arguments): `torch --device cuda:1` is the built-in
    torch driver with `--device cuda:1` after the common driver arguments; an address
    (`unix:PATH`, `tcp:HOST:PORT`) is a driver started elsewhere, and takes no arguments."""
    try:
        words = shlex.split(entry)
    except ValueError as exc:
        raise DriverEntryError(f"cannot split {entry!r} into a driver and its arguments: {exc}") from None
    if not words:
        raise DriverEntryError("an empty driver entry")
    driver, args = words[0], tuple(words[1:])
    if args and driver not in builtin:
        raise DriverEntryError(
            f"{entry!r}: only a built-in driver ({', '.join(builtin)}) takes arguments; a driver at an "
            "address is started where it runs, with its own"
        )
    return driver, args


def owned_driver_env() -> dict[str, str]:
    """The environment of a driver this process starts and owns: the driver exits if this
    process dies without stopping it (`bridge_schema.transport.HOST_PID_ENV`)."""
    return {**os.environ, HOST_PID_ENV: str(os.getpid())}


def driver_argv(module_name: str, address: str, args: Sequence[str]) -> list[str]:
    """`python -m MODULE --listen ADDRESS ARGS...`, on this interpreter."""
    return [sys.executable, "-m", module_name, "--listen", address, *args]


def socket_path(address: str) -> str:
    """The file of a `unix:PATH` address."""
    return address.removeprefix("unix:")


def output_tail(log_path: str | os.PathLike[str], num_bytes: int = 3000) -> str:
    """The last `num_bytes` of a driver's output file, decoded: what its failure message quotes."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - num_bytes))
            return f.read().decode("utf-8", errors="replace").strip() or "(no driver output)"
    except OSError:
        return "(no driver output)"


def stop_process(proc: subprocess.Popen[bytes], *, exit_grace_s: float = 0.0, terminate_s: float = 5.0) -> None:
    """Wait up to `exit_grace_s` for a clean exit (after a Shutdown message), then SIGTERM, and
    SIGKILL if it still runs `terminate_s` later. Returns once the process is reaped."""
    for timeout_s, signal_next in ((exit_grace_s, proc.terminate), (terminate_s, proc.kill)):
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            signal_next()
    proc.wait()
