"""Every transport carries the same encoded frames: loopback, Unix socket and TCP."""

from __future__ import annotations

import socket
from pathlib import Path

import anyio
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, build_forward
from bridge_schema.client import Client
from bridge_schema.codec import decode
from bridge_schema.errors import ConnectionClosed, FieldError
from bridge_schema.messages import ErrorReply, ForwardResult, Hello
from bridge_schema.transport import connect, loopback_pair, parse_address
from drivers.dummy import create_driver
from drivers.serve import serve, serve_loopback

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _exercise(client: Client) -> None:
    hs = await client.hello(Hello(page_size=8))
    assert hs.page_size == 8
    f = build_forward(0, [RequestSpec(1, [1, 2], [0, 1], [0], 2, [OutputSpec(1)])])
    assert len((await client.request(f, ForwardResult)).tokens) == 1


async def test_loopback_still_encodes_and_decodes() -> None:
    host_end, driver_end = loopback_pair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_loopback, create_driver([]), driver_end)
        async with Client.open(host_end) as client:
            await _exercise(client)


async def test_loopback_garbage_gets_an_error_reply() -> None:
    host_end, driver_end = loopback_pair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_loopback, create_driver([]), driver_end)
        await host_end.send_payload(b"\xc1")
        reply = decode(await host_end.receive_payload())
        assert isinstance(reply, ErrorReply) and reply.code == "frame"
        await host_end.aclose()


async def test_unix_and_tcp(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address in (f"unix:{tmp_path / 'd.sock'}", f"tcp:127.0.0.1:{port}"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve, create_driver([]), address)
            for _ in range(100):
                try:
                    conn = await connect(address)
                    break
                except Exception:
                    await anyio.sleep(0.02)
            async with Client.open(conn) as client:
                await _exercise(client)
            tg.cancel_scope.cancel()


async def test_waiters_fail_when_the_link_dies() -> None:
    host_end, driver_end = loopback_pair()
    async with Client.open(host_end) as client:
        waiter = await client.submit(Hello())
        await driver_end.aclose()
        with pytest.raises(ConnectionClosed):
            await client.wait(waiter, ForwardResult)


@pytest.mark.parametrize("bad", ["", "unix:", "tcp:host", "tcp:host:99999", "http://x"])
def test_bad_addresses_are_named(bad: str) -> None:
    with pytest.raises(FieldError, match="unix:PATH or tcp:HOST:PORT"):
        parse_address(bad)
