"""The socket transport splits the byte stream into payloads itself (asyncio protocol layer):
whatever chunks the bytes arrive in (one byte at a time, several frames at once, a frame split
anywhere), the payloads come out whole and in order; an oversized header ends the stream with
a `FrameError` after the payloads before it; a connection that drops fails the reader."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge_schema.errors import ConnectionClosed, FrameError
from bridge_schema.framing import frame
from bridge_schema.transport import ProtocolConnection, _FrameProtocol


class _Transport:
    """Just what the protocol touches."""

    def __init__(self) -> None:
        self.is_paused = False

    def pause_reading(self) -> None:
        self.is_paused = True

    def is_closing(self) -> bool:
        return False


def _feed(protocol: _FrameProtocol, data: bytes, cuts: list[int]) -> None:
    last = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        if cut > last:
            protocol.data_received(data[last:cut])
            last = cut


def _protocol(max_frame_bytes: int = 1 << 20) -> _FrameProtocol:
    protocol = _FrameProtocol(max_frame_bytes)
    protocol.connection_made(_Transport())  # type: ignore[arg-type]
    return protocol


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=12), st.lists(st.integers(0, 5000), max_size=40))
def test_payloads_come_out_whole_whatever_the_chunking(payloads: list[bytes], cuts: list[int]) -> None:
    protocol = _protocol()
    _feed(protocol, b"".join(frame(p) for p in payloads), cuts)
    assert list(protocol.payloads) == payloads


def test_one_byte_at_a_time() -> None:
    protocol = _protocol()
    data = frame(b"abc") + frame(b"") + frame(b"x" * 70_000)
    for i in range(len(data)):
        protocol.data_received(data[i : i + 1])
    assert list(protocol.payloads) == [b"abc", b"", b"x" * 70_000]


def _run(coro: Any) -> Any:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_an_oversized_header_fails_the_reader_after_the_payloads_before_it() -> None:
    protocol = _protocol(max_frame_bytes=100)
    protocol.data_received(frame(b"ok") + (1000).to_bytes(4, "little") + b"junk")
    assert protocol.transport.is_paused  # type: ignore[union-attr]
    conn = ProtocolConnection(protocol)

    async def read_two() -> None:
        assert await conn.receive_payload() == b"ok"
        with pytest.raises(FrameError, match="exceeds"):
            await conn.receive_payload()

    _run(read_two())


def test_a_dropped_connection_fails_a_waiting_reader() -> None:
    protocol = _protocol()
    conn = ProtocolConnection(protocol)

    async def wait_then_drop() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, protocol.connection_lost, ConnectionResetError(104, "reset"))
        with pytest.raises(ConnectionClosed, match="reset"):
            await conn.receive_payload()

    _run(wait_then_drop())
