"""A real dummy driver process over a real Unix socket: bad frames get error replies, the
driver keeps serving, and a valid request sent afterwards succeeds."""

from __future__ import annotations

import random
import struct

import anyio
import numpy as np
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, build_forward
from bridge_schema.client import Client
from bridge_schema.codec import decode, encode
from bridge_schema.errors import ConnectionClosed, RemoteError, SchemaError
from bridge_schema.messages import (
    Ack,
    Adapter,
    Copy,
    ErrorReply,
    ForwardResult,
    Handshake,
    Health,
    HealthReply,
    Hello,
    Shutdown,
    Status,
)
from bridge_schema.transport import connect
from tests.bridge_schema.mutation import mutate
from tests.bridge_schema.samples import samples

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _valid_forward() -> object:
    return build_forward(0, [RequestSpec(1, [1, 2, 3], [0, 1, 2], [0], 3, [OutputSpec(2)])])


async def test_copy_and_adapter_reply_status_zero(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        copy = await client.request(Copy(src_pages=np.array([1], np.uint32), dst_pages=np.array([2], np.uint32)), Ack)
        adapter = await client.request(Adapter(op="load", adapter_id=1, path="/x"), Ack)
        assert copy.status == adapter.status == Status.OK
        health = await client.request(Health(), HealthReply)
        assert health.stats["pages_copied"] == 1 and health.stats["adapter_loads"] == 1


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (RequestSpec(1, [1], [0], [4096], 1, [OutputSpec(0)]), "pages"),
        (RequestSpec(1, [260], [0], [0], 1, [OutputSpec(0)]), "tokens"),
    ],
)
async def test_out_of_range_gets_an_error_reply_naming_the_field(
    dummy_address: str, spec: RequestSpec, field: str
) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        with pytest.raises(RemoteError) as info:
            await client.request(build_forward(0, [spec]), ForwardResult)
        assert info.value.status == Status.OUT_OF_RANGE and info.value.field == field
        result = await client.request(_valid_forward(), ForwardResult)  # type: ignore[arg-type]
        assert len(result.tokens) == 1


async def test_requests_before_hello_are_refused(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        with pytest.raises(RemoteError) as info:
            await client.request(_valid_forward(), ForwardResult)  # type: ignore[arg-type]
        assert info.value.status == Status.NOT_READY


async def test_fuzzed_frames_get_error_replies_and_the_driver_keeps_serving(dummy_address: str) -> None:
    rng = random.Random(99)
    payloads = [encode(m) for m in samples().values()]
    conn = await connect(dummy_address)
    await conn.send_payload(encode(Hello()))
    assert isinstance(decode(await conn.receive_payload()), Handshake)
    errors = sent = 0
    while sent < 2000:
        payload = mutate(rng.choice(payloads), rng)
        try:
            if isinstance(decode(payload), Shutdown):
                continue  # a mutation that happens to be a valid Shutdown would stop the driver
        except SchemaError:
            pass
        await conn.send_payload(payload)
        reply = decode(await conn.receive_payload())
        assert reply.IS_REPLY
        errors += isinstance(reply, ErrorReply)
        sent += 1
    assert errors > 1000
    await conn.send_payload(encode(Hello()))
    assert isinstance(decode(await conn.receive_payload()), Handshake)
    await conn.send_payload(encode(_valid_forward()))  # type: ignore[arg-type]
    assert isinstance(decode(await conn.receive_payload()), ForwardResult)
    await conn.aclose()


async def test_oversized_frame_closes_only_its_connection(dummy_address: str) -> None:
    conn = await connect(dummy_address)
    transport = conn._protocol.transport  # write a raw header announcing 1 GiB
    assert transport is not None
    transport.write(struct.pack("<I", (1 << 30) + 1))
    reply = decode(await conn.receive_payload())
    assert isinstance(reply, ErrorReply) and "exceeds" in reply.message
    with pytest.raises(ConnectionClosed):
        await conn.receive_payload()
    await conn.aclose()
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        assert len((await client.request(_valid_forward(), ForwardResult)).tokens) == 1  # type: ignore[arg-type]


async def test_pipelined_requests_are_paired_by_id(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        waiters = [
            await client.submit(
                build_forward(0, [RequestSpec(1, [1] * n, list(range(n)), [0], n, [OutputSpec(i) for i in range(n)])])
            )
            for n in range(1, 9)
        ]
        results = [await client.wait(w, ForwardResult) for w in waiters]
        assert [len(r.tokens) for r in results] == list(range(1, 9))


async def test_shutdown_stops_the_driver_and_waiters_fail_cleanly(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        await client.request(Shutdown(), Ack)
        with pytest.raises(ConnectionClosed):
            for _ in range(50):  # the driver closes the connection once it has replied
                await client.request(Health(), HealthReply)
                await anyio.sleep(0.05)
    with pytest.raises(Exception, match="cannot connect"):
        for _ in range(50):
            await (await connect(dummy_address)).aclose()
            await anyio.sleep(0.05)
