"""attention_sink: sinks + a sliding window with bounded memory. Pages wholly outside both are
released (holes in the middle of the context, positions unchanged), so a run decodes well past
its page budget; a pass that would read a released page is refused."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge_schema.batch import OutputSpec
from host.build import build
from host.engine import Engine, EngineConfig
from host.errors import InvalidRequest
from host.sandbox import Sandbox
from host.services import PassRequest

PAGE, NUM_PAGES = 4, 12  # 48 slots in all
_runs = itertools.count(90_000)


@pytest.fixture(scope="module")
def small_engine() -> Iterator[Engine]:
    args = ["--page-size", str(PAGE), "--num-pages", str(NUM_PAGES)]
    with Engine.start(EngineConfig("dummy", args, speculation_depth=1)) as e:
        yield e


def test_decodes_far_past_its_page_budget(sandbox: Sandbox, cache_dir: Path, small_engine: Engine) -> None:
    component = sandbox.load(build("attention_sink", cache_dir).wasm_path)
    args = ["--prompt", "hello world", "--window", "8", "--sinks", "4", "--max-tokens", "150", "--ignore-eos"]
    outcome = sandbox.run(component, small_engine, args)
    assert outcome.is_ok, outcome.error
    assert "[released " in outcome.output  # 161 slots went through a 48-slot pool
    assert small_engine.num_free_pages == NUM_PAGES


def test_rolls_over_into_a_new_context_at_the_context_length(sandbox: Sandbox, cache_dir: Path) -> None:
    """Positions count from a context's start, so even a bounded window ends at the model's
    context length (64 here): the example goes on in a new context holding the sinks and the
    window, instead of failing there."""
    args = ["--page-size", str(PAGE), "--num-pages", str(NUM_PAGES), "--max-context", "64"]
    with Engine.start(EngineConfig("dummy", args, speculation_depth=1)) as e:
        component = sandbox.load(build("attention_sink", cache_dir).wasm_path)
        opts = ["--prompt", "hello world", "--window", "8", "--sinks", "4", "--max-tokens", "150", "--ignore-eos"]
        outcome = sandbox.run(component, e, opts)
        assert outcome.is_ok, outcome.error
        # 150 steps: 53 in the first context (11 prompt tokens, to 64), 52 in the second (from
        # its 12: the sinks and the window), the rest in a third.
        assert "rolled over 2 times]" in outcome.output, outcome.output[-200:]
        assert e.num_free_pages == NUM_PAGES


def test_without_releasing_the_same_run_runs_out_of_pages(
    sandbox: Sandbox, cache_dir: Path, small_engine: Engine
) -> None:
    component = sandbox.load(build("windowed_attention", cache_dir).wasm_path)
    args = ["--prompt", "hello world", "--window", "8", "--sinks", "4", "--max-tokens", "150", "--ignore-eos"]
    outcome = sandbox.run(component, small_engine, args)
    assert not outcome.is_ok and "pages" in (outcome.error or "").lower()
    assert small_engine.num_free_pages == NUM_PAGES


def test_a_pass_that_would_read_a_released_page_is_refused(small_engine: Engine) -> None:
    e, run = small_engine, next(_runs)
    ctx = e.create_context(run)
    e.forward(run, ctx, PassRequest(tokens=list(range(20)), outputs=[OutputSpec(19)], attention_window=8))
    assert e.release_slots(run, ctx, 4, 12) == 2  # pages 1 and 2: slots 4..11
    with pytest.raises(InvalidRequest, match="released pages"):
        e.forward(run, ctx, PassRequest(tokens=[5], outputs=[OutputSpec(0)]))  # causal: reads everything
    with pytest.raises(InvalidRequest, match="released page 2"):
        e.forward(run, ctx, PassRequest(tokens=[5], outputs=[OutputSpec(0)], attention_window=10))
    e.forward(run, ctx, PassRequest(tokens=[5], outputs=[OutputSpec(0)], attention_window=8, attention_sinks=4))
    assert e.context_length(run, ctx) == 21
    e.end_run(run)
    assert e.num_free_pages == NUM_PAGES


def test_released_pages_no_longer_count_as_held(small_engine: Engine) -> None:
    e, run = small_engine, next(_runs)
    ctx = e.create_context(run)
    e.forward(run, ctx, PassRequest(tokens=list(range(20)), outputs=[OutputSpec(19)], attention_window=8))
    assert e.context_num_pages(run, ctx) == 5 and e.run_usage(run) == (1, 5)
    assert e.release_slots(run, ctx, 4, 12) == 2
    assert e.context_num_pages(run, ctx) == 3 and e.run_usage(run) == (1, 3)
    e.end_run(run)


def test_a_run_that_releases_pages_grows_within_its_quota() -> None:
    """The page quota counts what a run holds: released pages are given back, so a sinks +
    window run stays inside its share however long it decodes."""
    args = ["--page-size", str(PAGE), "--num-pages", str(NUM_PAGES)]
    with Engine.start(
        EngineConfig("dummy", args, speculation_depth=0, max_run_page_fraction=0.5)
    ) as e:  # 6 pages a run
        run = next(_runs)
        ctx = e.create_context(run)
        window = {"attention_window": 8, "attention_sinks": 4}
        e.forward(run, ctx, PassRequest(tokens=list(range(20)), outputs=[OutputSpec(19)], **window))  # 5 pages
        assert e.release_slots(run, ctx, 4, 12) == 2  # 3 held
        e.forward(run, ctx, PassRequest(tokens=list(range(8)), outputs=[OutputSpec(7)], **window))  # +2: 5 held
        assert e.context_num_pages(run, ctx) == 5
        e.end_run(run)
