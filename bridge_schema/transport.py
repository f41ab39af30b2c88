"""Connections carrying framed payloads, on anyio: Unix socket, TCP and in-process loopback.

Addresses are strings: `unix:/path/to.sock`, `tcp:host:port`. A loopback pair passes payload
bytes through memory object streams; messages are still encoded and decoded on both sides.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from bridge_schema.codec import decode, encode
from bridge_schema.errors import ConnectionClosed, FieldError, FrameError, TransportError
from bridge_schema.framing import DEFAULT_MAX_FRAME_BYTES, HEADER_BYTES, frame, payload_length
from bridge_schema.limits import Limits
from bridge_schema.messages import Message

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


class StreamConnection:
    """Frames over a byte stream (Unix or TCP socket)."""

    def __init__(self, stream: anyio.abc.ByteStream, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()  # socket streams refuse two concurrent writers
        self.max_frame_bytes = max_frame_bytes

    async def send_payload(self, payload: bytes) -> None:
        try:
            async with self._send_lock:
                await self._stream.send(frame(payload, self.max_frame_bytes))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ConnectionClosed(f"send failed: {exc}") from None

    async def receive_payload(self) -> bytes:
        """The next payload. `FrameError` for an oversized frame (the stream is then out of
        sync: close it); `ConnectionClosed` at end of stream."""
        try:
            header = await self._reader.receive_exactly(HEADER_BYTES)
            length = payload_length(header, self.max_frame_bytes)
            return await self._reader.receive_exactly(length) if length else b""
        except anyio.IncompleteRead:
            raise ConnectionClosed("peer closed the connection") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError) as exc:
            raise ConnectionClosed(f"receive failed: {exc!r}") from None

    async def aclose(self) -> None:
        await self._stream.aclose()


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
        if len(payload) > self.max_frame_bytes:
            raise FrameError(f"frame of {len(payload)} bytes exceeds the maximum {self.max_frame_bytes}")
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


async def connect(address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> StreamConnection:
    kind, where, port = parse_address(address)
    try:
        stream: anyio.abc.ByteStream
        if kind == "unix":
            stream = await anyio.connect_unix(where)
        else:
            stream = await anyio.connect_tcp(where, port)
    except OSError as exc:
        raise TransportError(f"cannot connect to {address}: {exc}") from None
    return StreamConnection(stream, max_frame_bytes)


async def listen(
    address: str,
    handler: Callable[[StreamConnection], Awaitable[None]],
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ready: Callable[[], None] | None = None,
) -> None:
    """Accept connections forever, running `handler` on each (concurrently)."""
    kind, where, port = parse_address(address)
    listener: anyio.abc.Listener[anyio.abc.SocketStream]
    if kind == "unix":
        listener = await anyio.create_unix_listener(where)
    else:
        listener = await anyio.create_tcp_listener(local_host=where, local_port=port)

    async def on_connection(stream: anyio.abc.SocketStream) -> None:
        await handler(StreamConnection(stream, max_frame_bytes))

    async with listener:
        if ready is not None:
            ready()
        await listener.serve(on_connection)


def run(func: Callable[..., Awaitable[T]], *args: object) -> T:
    """`anyio.run` on asyncio, with uvloop when it is installed (it halves socket round trips)."""
    return anyio.run(func, *args, backend_options={"use_uvloop": _HAS_UVLOOP})
