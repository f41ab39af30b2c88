"""One host at a time: which host connection a listening driver serves, and who that is (for
the refusal every other connection gets meanwhile). Knows sockets only to name the peer; the
serve loop (`drivers.serve`) decides what to do with a connection.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import anyio

from bridge_schema.transport import ProtocolConnection

_MAX_COMMAND_CHARS = 160


class HostSlot:
    """Held by the connection being served. Page memory and serve state are one host's: a second
    host writing into the same pages would corrupt the first one's contexts (and its `Hello`
    would reallocate them), so a driver refuses other hosts while one is served."""

    def __init__(self) -> None:
        self.holder = ""  # who holds it, in words; "" when free
        self.since = 0.0  # time.monotonic() when it was taken
        self._released = anyio.Event()

    @property
    def is_held(self) -> bool:
        return bool(self.holder)

    def take(self, holder: str) -> None:
        assert not self.holder, "taken while held"
        self.holder, self.since = holder, time.monotonic()
        self._released = anyio.Event()

    def release(self) -> None:
        self.holder = ""
        self._released.set()

    async def wait_released(self, timeout_s: float) -> bool:
        """Whether the slot is free within `timeout_s`. A host that just disconnected may hold it
        a moment longer than its socket (its serve task still winding down), and the next host's
        first request must not be refused for that."""
        if self.holder:
            with anyio.move_on_after(timeout_s):
                await self._released.wait()
        return not self.holder

    def refusal(self) -> str:
        held_s = time.monotonic() - self.since
        return (
            f"this driver serves one host at a time, and another host holds it: {self.holder}, "
            f"connected {held_s:.0f} s ago; try again once it has disconnected, or use a driver of your own"
        )


def describe_peer(conn: ProtocolConnection) -> str:
    """Who is at the other end: on a Unix socket the peer's pid, command and uid (SO_PEERCRED,
    Linux), on TCP its address."""
    peername = conn.extra_info("peername")
    if isinstance(peername, tuple) and len(peername) >= 2:
        return f"the host at {peername[0]}:{peername[1]}"
    sock = conn.extra_info("socket")
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None:
        return "a local host (its process is not known on this system)"
    try:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    except OSError:
        return "a local host (its process is not known)"
    return f"pid {pid} ({_command(pid)}), uid {uid}"


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "command unknown"
    command = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", errors="replace")
    if len(command) > _MAX_COMMAND_CHARS:
        command = command[: _MAX_COMMAND_CHARS - 3] + "..."
    return command or "command unknown"
