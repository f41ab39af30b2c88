"""The dummy driver's simulated pass latency models a device queue: passes sent back to back
run one after the other, each for L, and each reply is due when its pass ends (not earlier,
whatever the machine's load), while the driver goes on reading the frames behind it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, build_forward
from bridge_schema.client import Client
from bridge_schema.messages import ForwardResult, Health, HealthReply, Hello
from bridge_schema.transport import connect
from tests.conftest import start_dummy

pytestmark = pytest.mark.anyio
LATENCY_S = 0.05


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def slow_dummy(tmp_path: Path) -> Iterator[str]:
    sock = tmp_path / "slow.sock"
    proc = start_dummy(sock, "--pass-latency-ms", str(LATENCY_S * 1000))
    yield f"unix:{sock}"
    proc.terminate()
    proc.wait(timeout=10)


async def test_back_to_back_passes_queue_and_replies_keep_their_order(slow_dummy: str) -> None:
    async with Client.open(await connect(slow_dummy)) as client:
        await client.hello(Hello())
        arrived: list[tuple[str, float]] = []
        t0 = time.perf_counter()
        waiters = []
        for i in range(3):
            message = build_forward(0, [RequestSpec(i, [1, 2], [0, 1], [i], 2, [OutputSpec(1)])])
            waiters.append(
                await client.submit(message, lambda w, i=i: arrived.append((f"pass {i}", time.perf_counter())))
            )
        waiters.append(await client.submit(Health(), lambda w: arrived.append(("health", time.perf_counter()))))
        for w in waiters[:3]:
            await client.wait(w, ForwardResult)
        await client.wait(waiters[3], HealthReply)
        await anyio.sleep(0)
    assert [name for name, _ in arrived] == ["pass 0", "pass 1", "pass 2", "health"]
    # Pass k ends (k + 1) x L after the first was sent, at the earliest: one device, one pass at a time.
    for k in range(3):
        assert arrived[k][1] - t0 >= (k + 1) * LATENCY_S * 0.999
