"""`python -m drivers.torch` as a real process on a Unix socket: handshake, forward, a bad mask
gets an error reply naming the field, the driver keeps serving, Copy/Adapter/Health work."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bridge_schema.client import Client
from bridge_schema.errors import RemoteError
from bridge_schema.messages import Ack, Copy, ForwardResult, Health, HealthReply, Hello, Status
from bridge_schema.transport import connect
from tests.drivers.torch.helpers import brle, forward, request, write_tiny_gemma
from tests.listening import wait_until_listening

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def address(tmp_path: Path) -> Iterator[str]:
    model = write_tiny_gemma(tmp_path / "gemma", sliding_window=4)
    sock = tmp_path / "torch.sock"
    cmd = [sys.executable, "-m", "drivers.torch", "--model", str(model), "--threads", "1"]
    proc = subprocess.Popen([*cmd, "--listen", f"unix:{sock}", "--log-level", "WARNING"])
    wait_until_listening(sock, proc, 120)
    yield f"unix:{sock}"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


async def test_serves_over_a_socket_and_survives_bad_requests(address: str) -> None:
    async with Client.open(await connect(address)) as client:
        hs = await client.hello(Hello(page_size=4, num_pages=16))
        assert hs.driver_kind == "torch" and hs.page_size == 4 and hs.num_pages == 16 and hs.vocab_size == 96
        ok = forward([request([5, 6, 7, 8, 9], 0, [3, 4], 4)])
        first = await client.request(ok, ForwardResult)
        short_mask = forward([request([10], 5, [3, 4], 4, mask_rows=[brle([True] * 5)])])  # kv_len is 6
        with pytest.raises(RemoteError) as err:
            await client.request(short_mask, ForwardResult)
        assert err.value.status == Status.BAD_REQUEST and err.value.field == "mask_runs"  # a shape error
        again = await client.request(forward([request([5, 6, 7, 8, 9], 0, [3, 4], 4)]), ForwardResult)
        assert again.tokens.tolist() == first.tokens.tolist()
        copy = Copy(src_pages=np.array([3, 4], np.uint32), dst_pages=np.array([7, 8], np.uint32))
        assert (await client.request(copy, Ack)).status == Status.OK
        health = await client.request(Health(), HealthReply)
        assert health.stats["forwards"] == 2
