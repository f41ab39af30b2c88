"""Shared fixtures: a real dummy driver process on a real Unix socket."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def start_dummy(socket_path: Path, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "drivers.dummy", "--listen", f"unix:{socket_path}", "--log-level", "WARNING", *args]
    )
    deadline = time.monotonic() + 30
    while not _accepts(socket_path):  # the socket file exists a moment before it accepts
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"dummy driver did not start (exit status {proc.poll()})")
        time.sleep(0.02)
    return proc


def _accepts(socket_path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(socket_path))
        except OSError:
            return False
    return True


@pytest.fixture
def dummy_address(tmp_path: Path) -> Iterator[str]:
    """Address of a fresh dummy driver process, stopped after the test."""
    sock = tmp_path / "dummy.sock"
    proc = start_dummy(sock)
    yield f"unix:{sock}"
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
