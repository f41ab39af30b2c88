"""Waiting for a driver started by a test to listen on its Unix socket.

The socket's file appears when the server binds it, a moment before it listens; a connection in
between is refused. On a busy machine that moment can last milliseconds (the driver's process
descheduled between the two calls), so a test that waited only for the file failed now and then
with "Connection refused". The host waits the same way (`host/driver_link.py`)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from host.cli.kept_drivers import accepts


def wait_until_listening(sock: Path, proc: subprocess.Popen[bytes], timeout_s: float, log: Path | None = None) -> None:
    """Return once `proc` accepts connections on `sock`; kill it and raise RuntimeError (with the
    tail of `log`, when given) if it exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not (sock.exists() and accepts(str(sock))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = log.read_text(errors="replace")[-2000:] if log is not None else ""
            raise RuntimeError(f"driver did not listen on {sock} (exit status {proc.poll()}): {tail}")
        time.sleep(0.02)
