"""Shared fixtures: a real dummy driver process on a real Unix socket."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.listening import wait_until_listening


def start_dummy(socket_path: Path, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "drivers.dummy", "--listen", f"unix:{socket_path}", "--log-level", "WARNING", *args]
    )
    wait_until_listening(socket_path, proc, 30)
    return proc


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
