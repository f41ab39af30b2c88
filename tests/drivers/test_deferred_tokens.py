"""Deferred tokens over a real socket to a real dummy driver process: a pass sent before the
reply of the pass it follows gets that pass's sampled token as its input, never a stale one.

The dummy's greedy draw depends on the input token and its position (not on the context), so a
deferred step must sample exactly what the same step sent with the token spelled out samples.
"""

from __future__ import annotations

import anyio
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward
from bridge_schema.client import Client
from bridge_schema.errors import RemoteError
from bridge_schema.messages import DEFERRED_TOKENS, ForwardResult, Hello, Status
from bridge_schema.transport import connect

pytestmark = pytest.mark.anyio

CTX = 9
GREEDY = OutputSpec(0, Sampler.greedy())


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _prompt(ctx: int = CTX) -> object:
    return build_forward(0, [RequestSpec(ctx, [1, 2, 3], [0, 1, 2], [0], 3, [OutputSpec(2, Sampler.greedy())])])


def _step(token: int, position: int, deferred: bool = False, ctx: int = CTX) -> object:
    spec = RequestSpec(ctx, [0 if deferred else token], [position], [0], position + 1, [GREEDY], deferred=deferred)
    return build_forward(0, [spec])


async def test_the_capability_is_advertised(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        assert DEFERRED_TOKENS in (await client.hello(Hello())).capabilities


async def test_pipelined_deferred_steps_continue_from_the_pass_before(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        # Three passes sent back to back, before any reply: each step's token comes from the one before.
        waiters = [
            await client.submit(_prompt()),  # type: ignore[arg-type]
            await client.submit(_step(0, 3, deferred=True)),  # type: ignore[arg-type]
            await client.submit(_step(0, 4, deferred=True)),  # type: ignore[arg-type]
        ]
        t0, t1, t2 = [int((await client.wait(w, ForwardResult)).tokens[0]) for w in waiters]
        # The same steps with the tokens spelled out, on another context.
        spelled = [
            int((await client.request(_step(t, p, ctx=CTX + 1), ForwardResult)).tokens[0])
            for t, p in ((t0, 3), (t1, 4))
        ]  # type: ignore[arg-type]
        assert [t1, t2] == spelled
        assert len({t0, t1, t2}) > 1  # the draws depend on the input (else this test proves nothing)


async def test_a_context_with_no_sampled_token_is_refused_and_the_driver_keeps_serving(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        with pytest.raises(RemoteError) as info:
            await client.request(_step(0, 3, deferred=True, ctx=77), ForwardResult)  # type: ignore[arg-type]
        assert info.value.status == Status.OUT_OF_RANGE and info.value.field == "deferred"
        assert "context 77" in str(info.value)
        result = await client.request(_prompt(), ForwardResult)  # type: ignore[arg-type]
        assert len(result.tokens) == 1


@pytest.mark.parametrize("failure", ["refused", "malformed"])
async def test_a_failed_pass_is_never_continued_from_a_stale_token(dummy_address: str, failure: str) -> None:
    """After a pass on the context fails (refused by the driver, or not even decodable), the
    token sampled before it is not what a deferred step expects: it is refused instead."""
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        await client.request(_prompt(), ForwardResult)  # type: ignore[arg-type]
        if failure == "refused":  # an adapter that is not loaded: the driver refuses the pass
            bad = build_forward(0, [RequestSpec(CTX, [5], [3], [0], 4, [GREEDY], adapter_id=3)])
        else:  # a page out of range: the frame fails validation
            bad = build_forward(0, [RequestSpec(CTX, [5], [3], [4096], 4, [GREEDY])])
        with pytest.raises(RemoteError):
            await client.request(bad, ForwardResult)
        with pytest.raises(RemoteError) as info:
            await client.request(_step(0, 3, deferred=True), ForwardResult)  # type: ignore[arg-type]
        assert info.value.field == "deferred"


async def test_a_new_connection_starts_with_nothing_remembered(dummy_address: str) -> None:
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        await client.request(_prompt(), ForwardResult)  # type: ignore[arg-type]
    await anyio.sleep(0)
    async with Client.open(await connect(dummy_address)) as client:
        await client.hello(Hello())
        with pytest.raises(RemoteError) as info:
            await client.request(_step(0, 3, deferred=True), ForwardResult)  # type: ignore[arg-type]
        assert info.value.field == "deferred"
