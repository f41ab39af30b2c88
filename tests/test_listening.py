"""The tests' wait for a driver's socket: a socket bound but not yet listening is not ready."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from host.cli.kept_drivers import accepts
from tests.listening import wait_until_listening


def test_a_bound_socket_is_ready_only_once_it_listens() -> None:
    # A short path: tmp_path can exceed the 107 bytes a Unix socket's path may have.
    with tempfile.TemporaryDirectory(prefix="wafer-") as tmp, socket.socket(socket.AF_UNIX) as server:
        sock = Path(tmp) / "d.sock"
        server.bind(str(sock))  # the file exists from here on; connections are refused
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert sock.exists() and not accepts(str(sock))
            with pytest.raises(RuntimeError, match="did not listen"):
                wait_until_listening(sock, proc, 0.3)
        finally:
            proc.kill()
            proc.wait()
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            server.listen()
            wait_until_listening(sock, proc, 5)
            assert proc.poll() is None
        finally:
            proc.kill()
            proc.wait()
