"""A listening driver serves one host at a time (`drivers.host_slot`), over a real Unix socket
to a real dummy driver process: a second host is refused with a reply naming the host that holds
the driver, then closed; once that host leaves, the next is served on a fresh serve state."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, build_forward
from bridge_schema.client import Client
from bridge_schema.codec import decode, encode
from bridge_schema.errors import ConnectionClosed, RemoteError
from bridge_schema.messages import Ack, Adapter, ErrorReply, ForwardResult, Health, HealthReply, Hello, Status
from bridge_schema.transport import DRIVER_BUSY, connect
from tests.conftest import start_dummy

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def slow_dummy_address(tmp_path: Path) -> Iterator[str]:
    """A dummy driver whose passes take 500 ms (a device queue: `drivers.protocol`)."""
    sock = tmp_path / "slow.sock"
    proc = start_dummy(sock, "--pass-latency-ms", "500")
    yield f"unix:{sock}"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _forward() -> object:
    return build_forward(0, [RequestSpec(1, [1, 2, 3], [0, 1, 2], [0], 3, [OutputSpec(2)])])


async def test_a_second_host_is_refused_naming_the_holder(dummy_address: str) -> None:
    silent = await connect(dummy_address)  # connected, but no request yet: it holds nothing
    async with Client.open(await connect(dummy_address)) as holder:
        await holder.hello(Hello())
        second = await connect(dummy_address)
        await second.send_payload(encode(Hello(id=7)))
        with anyio.fail_after(10):
            reply = decode(await second.receive_payload())
            assert isinstance(reply, ErrorReply) and reply.id == 7
            assert (reply.status, reply.code) == (Status.NOT_READY, DRIVER_BUSY)
            assert f"pid {os.getpid()} (" in reply.message and "pytest" in reply.message  # SO_PEERCRED
            with pytest.raises(ConnectionClosed):  # and closed: the refused host is not left waiting
                await second.receive_payload()
        await second.aclose()
        async with Client.open(silent) as late:
            with pytest.raises(RemoteError, match="serves one host at a time"):
                await late.request(Health(), HealthReply)  # its first request, now: refused too
        assert len((await holder.request(_forward(), ForwardResult)).tokens) == 1  # type: ignore[arg-type]


async def test_the_next_host_is_served_on_a_fresh_state_once_the_holder_leaves(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as first:
        await first.hello(Hello())
        await first.request(Adapter(op="load", adapter_id=3, path="/a"), Ack)
    # Right after the first host closed: served (the driver waits for the holder to let go).
    async with Client.open(await connect(dummy_address)) as second:
        health = await second.request(Health(), HealthReply)
        assert health.state == "awaiting_hello"  # its own serve state: no handshake yet
        assert health.stats["adapter_unloads"] == 1  # the first host's adapter went with it
        with pytest.raises(RemoteError) as info:
            await second.request(_forward(), ForwardResult)  # type: ignore[arg-type]
        assert info.value.status == Status.NOT_READY and info.value.code == "not_ready"
        await second.hello(Hello())
        assert len((await second.request(_forward(), ForwardResult)).tokens) == 1  # type: ignore[arg-type]


async def test_a_host_that_just_left_does_not_get_the_next_one_refused(slow_dummy_address: str) -> None:
    """A host gone with a pass in flight holds the driver until that pass is done (500 ms here,
    a model's forward on a real driver); the next host's hello waits for it rather than being
    refused."""
    gone = await connect(slow_dummy_address)
    await gone.send_payload(encode(Hello(id=1)))
    assert decode(await gone.receive_payload()).id == 1
    await gone.send_payload(encode(_forward()))  # type: ignore[arg-type]
    await gone.aclose()
    async with Client.open(await connect(slow_dummy_address)) as client:
        await client.hello(Hello())
