"""Connections carrying framed payloads: Unix socket and TCP (on asyncio's protocol layer, under
anyio), and in-process loopback (anyio memory streams).

Addresses are strings: `unix:/path/to.sock`, `tcp:host:port`. A loopback pair passes payload
bytes through memory object streams; messages are still encoded and decoded on both sides.
A Unix socket a driver listens on is its owner's alone (mode 0600, whatever the umask).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from bridge_schema.codec import decode, encode
from bridge_schema.errors import ConnectionClosed, FieldError, FrameError, TransportError
from bridge_schema.framing import DEFAULT_MAX_FRAME_BYTES, HEADER, HEADER_BYTES, check_length
from bridge_schema.limits import Limits
from bridge_schema.messages import Message

# Set by a host in the environment of a driver process it starts and owns, to its own pid: the
# driver exits when that process is gone (`drivers.serve.serve_forever`), so a host killed before
# it could stop its driver leaves none behind holding its memory. Drivers started on their own
# (`wafer driver start`, a driver at an address) never get it.
HOST_PID_ENV = "WAFER_HOST_PID"

# The `ErrorReply.code` a driver answers a connection's first request with while it serves another
# host (`drivers.host_slot`): one page pool and serve state cannot be shared by two hosts.
DRIVER_BUSY = "driver_busy"

T = TypeVar("T")
_HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


class Connection(Protocol):
    """A bidirectional stream of payloads (one msgpack message each)."""

    async def send_payload(self, payload: bytes) -> None: ...

    async def receive_payload(self) -> bytes: ...

    async def aclose(self) -> None: ...


async def send(conn: Connection, message: Message) -> None:
    await conn.send_payload(encode(message))


async def receive(conn: Connection, limits: Limits | None = None) -> Message:
    return decode(await conn.receive_payload(), limits)


class _FrameProtocol(asyncio.Protocol):
    """Splits the byte stream into payloads as it arrives (in the event loop's callback, with no
    task switch per frame) and queues them for `ProtocolConnection.receive_payload`."""

    def __init__(self, max_frame_bytes: int, on_made: Callable[[_FrameProtocol], None] | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._on_made = on_made
        self.transport: asyncio.Transport | None = None
        self.payloads: deque[bytes] = deque()
        self.error: Exception | None = None  # raised once the queued payloads are read
        self._buffer = bytearray()
        self._need = HEADER_BYTES  # bytes the next item needs: a header, or a header + payload
        self._reader: asyncio.Future[None] | None = None
        self._drains: list[asyncio.Future[None]] = []  # writers waiting for the buffer to drain
        self._is_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are duck-typed, not subclasses
        if self._on_made is not None:
            self._on_made(self)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if len(buffer) < self._need:
            return
        start, end = 0, len(buffer)
        with memoryview(buffer) as view:
            while end - start >= HEADER_BYTES:
                (length,) = HEADER.unpack_from(buffer, start)
                try:
                    check_length(length, self.max_frame_bytes)
                except FrameError as exc:  # the stream is out of sync: no frame follows
                    self.error = exc
                    assert self.transport is not None
                    self.transport.pause_reading()
                    break
                if end - start < HEADER_BYTES + length:
                    self._need = HEADER_BYTES + length
                    break
                self.payloads.append(bytes(view[start + HEADER_BYTES : start + HEADER_BYTES + length]))
                start += HEADER_BYTES + length
            else:
                self._need = HEADER_BYTES
        del buffer[:start]
        self._wake_reader()

    def eof_received(self) -> bool:
        self._fail(ConnectionClosed("peer closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionClosed(f"connection lost: {exc!r}" if exc else "peer closed the connection"))
        self._release_writers()

    def pause_writing(self) -> None:
        self._is_paused = True

    def resume_writing(self) -> None:
        self._is_paused = False
        self._release_writers()

    async def drained(self) -> None:
        if self._is_paused and not self._closed():
            waiter = asyncio.get_running_loop().create_future()
            self._drains.append(waiter)
            await waiter

    def _release_writers(self) -> None:
        drains, self._drains = self._drains, []
        for waiter in drains:
            if not waiter.done():
                waiter.set_result(None)

    async def next_payload(self) -> bytes:
        while not self.payloads:
            if self.error is not None:
                raise self.error
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        return self.payloads.popleft()

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._wake_reader()

    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def _closed(self) -> bool:
        return self.transport is None or self.transport.is_closing()


class ProtocolConnection:
    """Frames over a Unix or TCP socket, on asyncio's protocol layer: frames are split in the
    loop's data callback and written without a lock or a copy (the loop runs one writer at a
    time), which saves several task switches per round trip over a stream abstraction."""

    def __init__(self, protocol: _FrameProtocol) -> None:
        self._protocol = protocol
        self.max_frame_bytes = protocol.max_frame_bytes

    async def send_payload(self, payload: bytes) -> None:
        transport = self._protocol.transport
        if transport is None or transport.is_closing():
            raise ConnectionClosed("send failed: the connection is closed")
        transport.writelines((HEADER.pack(check_length(len(payload), self.max_frame_bytes)), payload))
        await self._protocol.drained()

    async def receive_payload(self) -> bytes:
        """The next payload. `FrameError` for an oversized frame (the stream is then out of
        sync: close it); `ConnectionClosed` at end of stream."""
        return await self._protocol.next_payload()

    async def aclose(self) -> None:
        transport = self._protocol.transport
        if transport is not None:
            transport.close()  # what was written is still flushed
        await anyio.lowlevel.checkpoint()

    def extra_info(self, name: str) -> Any:
        """asyncio's `BaseTransport.get_extra_info` ("socket", "peername"): who is at the other end."""
        transport = self._protocol.transport
        return None if transport is None else transport.get_extra_info(name)


class LoopbackConnection:
    """One end of an in-process pair."""

    def __init__(
        self,
        send_stream: MemoryObjectSendStream[bytes],
        receive_stream: MemoryObjectReceiveStream[bytes],
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self._send = send_stream
        self._receive = receive_stream
        self.max_frame_bytes = max_frame_bytes

    async def send_payload(self, payload: bytes) -> None:
        check_length(len(payload), self.max_frame_bytes)
        try:
            await self._send.send(bytes(payload))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise ConnectionClosed("loopback peer is closed") from None

    async def receive_payload(self) -> bytes:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise ConnectionClosed("loopback peer is closed") from None

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()


def loopback_pair() -> tuple[LoopbackConnection, LoopbackConnection]:
    a_send, b_receive = anyio.create_memory_object_stream[bytes](math.inf)
    b_send, a_receive = anyio.create_memory_object_stream[bytes](math.inf)
    return LoopbackConnection(a_send, a_receive), LoopbackConnection(b_send, b_receive)


def parse_address(address: str) -> tuple[str, str, int]:
    """`unix:PATH` -> ("unix", PATH, 0); `tcp:HOST:PORT` -> ("tcp", HOST, PORT)."""
    kind, _, rest = address.partition(":")
    if kind == "unix" and rest:
        return "unix", rest, 0
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        if host and port.isdigit() and 0 <= int(port) < 65536:
            return "tcp", host, int(port)
    raise FieldError(f"expected unix:PATH or tcp:HOST:PORT, got {address!r}", "address")


async def connect(address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ProtocolConnection:
    kind, where, port = parse_address(address)
    loop = asyncio.get_running_loop()
    protocol = _FrameProtocol(max_frame_bytes)
    try:
        if kind == "unix":
            await loop.create_unix_connection(lambda: protocol, where)
        else:
            await loop.create_connection(lambda: protocol, where, port)
    except OSError as exc:
        raise TransportError(f"cannot connect to {address}: {exc}") from None
    _no_delay(protocol)
    return ProtocolConnection(protocol)


def _no_delay(protocol: _FrameProtocol) -> None:
    """TCP: send small frames at once (Nagle would hold a decode step back for an ACK)."""
    assert protocol.transport is not None
    sock = protocol.transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def listen(
    address: str,
    handler: Callable[[ProtocolConnection], Awaitable[None]],
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ready: Callable[[], None] | None = None,
) -> None:
    """Accept connections forever, running `handler` on each (concurrently)."""
    kind, where, port = parse_address(address)
    loop = asyncio.get_running_loop()
    accepted: asyncio.Queue[_FrameProtocol] = asyncio.Queue()

    def new_protocol() -> _FrameProtocol:
        return _FrameProtocol(max_frame_bytes, on_made=accepted.put_nowait)

    async def serve_one(protocol: _FrameProtocol) -> None:
        _no_delay(protocol)
        await handler(ProtocolConnection(protocol))

    server: asyncio.AbstractServer
    if kind == "unix":
        server = await loop.create_unix_server(new_protocol, sock=_bind_unix(where))
    else:
        server = await loop.create_server(new_protocol, where, port)
    try:
        if ready is not None:
            ready()
        async with anyio.create_task_group() as tg:
            while True:
                tg.start_soon(serve_one, await accepted.get())
    finally:
        server.close()


def _bind_unix(path: str) -> socket.socket:
    """A Unix socket bound at `path` with mode 0600: connecting needs write permission on the file,
    so only its owner can reach the driver. Set by the umask at bind time, since a chmod afterwards
    would leave a moment in which anyone may connect; the umask is the process's, so it is
    restored right after the bind."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(previous)
    return sock


def run(func: Callable[..., Awaitable[T]], *args: object) -> T:
    """`anyio.run` on asyncio, with uvloop when it is installed (it halves socket round trips)."""
    return anyio.run(func, *args, backend_options={"use_uvloop": _HAS_UVLOOP})
