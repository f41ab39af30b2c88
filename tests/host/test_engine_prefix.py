"""Prefix reuse at page granularity on the real dummy driver (loopback: every frame encoded),
and the prefix_match_unit rule at each of its three boundaries."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from bridge_schema.batch import OutputSpec, Sampler
from host.engine import Engine, EngineConfig
from host.errors import HostError, InvalidRequest
from host.services import PassRequest

PAGE = 4
_runs = itertools.count(5000)


def start(num_pages: int = 256, **kw: object) -> Engine:
    args = ["--num-pages", str(num_pages), "--page-size", str(PAGE)]
    return Engine.start(EngineConfig("loopback", args, prefix_match_unit=PAGE, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with start() as e:
        yield e


def fill(engine: Engine, run: int, tokens: list[int]) -> tuple[int, int]:
    """A new context filled with `tokens`; returns (context, greedy token after them)."""
    ctx = engine.create_context(run)
    out = engine.forward(run, ctx, PassRequest(tokens=tokens, outputs=[OutputSpec(len(tokens) - 1, Sampler())]))
    return ctx, out.outputs[0].token


def driver_tokens(engine: Engine) -> int:
    return int(engine.driver_health()["tokens"])


def test_a_17_token_prompt_with_4_token_pages_reuses_16_and_computes_1(engine: Engine) -> None:
    prompt = list(range(100, 117))
    run = next(_runs)
    cold_ctx, cold = fill(engine, run, prompt)
    before, tokens_before = engine.prefix_stats(), driver_tokens(engine)
    warm_ctx, warm = fill(engine, run, prompt)
    assert engine.prefix_stats()["prefix_tokens_reused"] - before["prefix_tokens_reused"] == 16
    assert driver_tokens(engine) - tokens_before == 1
    assert warm == cold and engine.context_length(run, warm_ctx) == 17
    assert engine.context_pages(warm_ctx)[:4] == engine.context_pages(cold_ctx)[:4]
    engine.end_run(run)


def test_an_exact_multiple_of_the_page_size_writes_no_shared_page(engine: Engine) -> None:
    prompt = list(range(30, 46))  # 16 tokens = 4 full pages
    run = next(_runs)
    cold_ctx, cold = fill(engine, run, prompt)
    tokens_before = driver_tokens(engine)
    warm_ctx, warm = fill(engine, run, prompt)
    assert driver_tokens(engine) - tokens_before == PAGE  # the last page is recomputed privately
    cold_pages, warm_pages = engine.context_pages(cold_ctx), engine.context_pages(warm_ctx)
    assert warm_pages[:3] == cold_pages[:3] and warm_pages[3] != cold_pages[3]
    assert engine.page_refcount(warm_pages[3]) == 1  # written by the warm pass: held by it alone
    assert warm == cold
    engine.end_run(run)


def test_reuse_needs_the_same_positions_and_adapter_and_outputs_stay_computed(engine: Engine) -> None:
    run = next(_runs)
    prompt = list(range(60, 73))
    fill(engine, run, prompt)
    before = engine.prefix_stats()["prefix_tokens_reused"]
    ctx = engine.create_context(run)
    shifted = PassRequest(tokens=prompt, positions=list(range(1, 14)), outputs=[OutputSpec(12)])
    engine.forward(run, ctx, shifted)  # other positions: other pages
    ctx = engine.create_context(run)
    every_row = PassRequest(tokens=prompt, outputs=[OutputSpec(i) for i in range(13)])
    assert len(engine.forward(run, ctx, every_row).outputs) == 13  # row 0 has an output: nothing reused
    assert engine.prefix_stats()["prefix_tokens_reused"] == before
    engine.end_run(run)


def test_decoded_pages_are_named_too(engine: Engine) -> None:
    run = next(_runs)
    ctx, token = fill(engine, run, [7, 8, 9])
    generated = [7, 8, 9, token]
    for _ in range(9):
        step = engine.forward(run, ctx, PassRequest(tokens=[generated[-1]], outputs=[OutputSpec(0)]))
        generated.append(step.outputs[0].token)
    before = engine.prefix_stats()["prefix_tokens_reused"]
    fill(engine, run, generated[:-1])  # 12 slots were written: 11 tokens reuse 2 full pages
    assert engine.prefix_stats()["prefix_tokens_reused"] - before == 8
    engine.end_run(run)


def test_eviction_under_page_pressure_keeps_every_run_correct() -> None:
    with (
        start(num_pages=12) as e,
        Engine.start(EngineConfig("loopback", ["--num-pages", "12", "--page-size", str(PAGE)])) as plain,
    ):
        for i in range(20):
            prompt = [(i * 37 + j) % 250 for j in range(9)]  # 3 pages each, mostly distinct
            run = next(_runs)
            _, token = fill(e, run, prompt)
            _, expected = fill(plain, run, prompt)
            assert token == expected
            e.end_run(run)
            plain.end_run(run)
        stats = e.prefix_stats()
        assert stats["prefix_evictions"] > 0 and stats["prefix_cached_pages"] <= 12
        # A prompt seen before eviction may or may not hit, but it is always right.
        run = next(_runs)
        assert (
            fill(e, run, [(19 * 37 + j) % 250 for j in range(9)])[1]
            == fill(plain, run, [(19 * 37 + j) % 250 for j in range(9)])[1]
        )


# ---------------------------------------------------------------------- the rule at three boundaries


def test_full_page_unit_with_speculation_is_accepted() -> None:
    with start(speculation_depth=1, page_size=PAGE) as e:
        assert e.model.page_size == PAGE


def test_sub_page_unit_is_rejected_at_configuration() -> None:
    with pytest.raises(InvalidRequest, match="configuration rejected"):
        Engine.start(EngineConfig("loopback", [], page_size=8, prefix_match_unit=4, speculation_depth=1))


def test_sub_page_unit_is_rejected_by_the_driver_that_resolved_a_larger_page() -> None:
    # Asked for 4-token pages, the driver resolves 8: the unit 4 is now sub-page, and the driver
    # itself refuses the Hello.
    with pytest.raises(HostError, match="prefix_match_unit"):
        Engine.start(
            EngineConfig("loopback", ["--min-page-size", "8"], page_size=4, prefix_match_unit=4, speculation_depth=1)
        )


@pytest.mark.parametrize("depth", [0, 1])
def test_sub_page_unit_is_rejected_by_the_host_after_the_handshake(depth: int) -> None:
    # A driver that does not check: the host still judges the unit against the resolved size.
    with pytest.raises(InvalidRequest, match="page size 8"):
        Engine.start(
            EngineConfig(
                "loopback",
                ["--min-page-size", "8"],
                driver_module="tests.host.lax_driver",
                page_size=4,
                prefix_match_unit=4,
                speculation_depth=depth,
            )
        )
