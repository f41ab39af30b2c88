"""Multi-step requests (`PassRequest.steps`, `Forward.steps`) and `Engine.generate`, against the
real dummy driver over a socket and over loopback: a multi-step pass samples what as many single
steps would, a generation that stops inside one gives its unused slots back, and the engine asks
for several steps only once it knows passes are short."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest

from bridge_schema.batch import OutputSpec, Sampler
from host.engine import Engine, EngineConfig
from host.errors import InvalidRequest, OutOfPages
from host.services import PassRequest, PassResult

PAGE = 4
_runs = itertools.count(1)
SAMPLERS = [Sampler(), Sampler.random(0.9, top_p=0.9, seed=5)]


@pytest.fixture(scope="module", params=["dummy", "loopback"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    with Engine.start(EngineConfig(request.param, ["--num-pages", "256", "--page-size", str(PAGE)])) as e:
        yield e


def _step(token: int, sampler: Sampler, steps: int = 1) -> PassRequest:
    return PassRequest(tokens=[token], outputs=[OutputSpec(0, sampler)], steps=steps)


def _prompt(engine: Engine, run: int, sampler: Sampler) -> tuple[int, int]:
    """A fresh context holding a 5-token prompt: (context, its first sampled token)."""
    ctx = engine.create_context(run)
    result = engine.forward(run, ctx, PassRequest(tokens=[10, 11, 12, 13, 14], outputs=[OutputSpec(4, sampler)]))
    return ctx, result.outputs[0].token


def _single_steps(engine: Engine, run: int, sampler: Sampler, n: int) -> list[int]:
    ctx, token = _prompt(engine, run, sampler)
    tokens = []
    for _ in range(n):
        token = engine.forward(run, ctx, _step(token, sampler)).outputs[0].token
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["greedy", "seeded"])
def test_a_multi_step_pass_samples_what_single_steps_sample(engine: Engine, sampler: Sampler) -> None:
    run = next(_runs)
    try:
        expected = _single_steps(engine, run, sampler, 11)
        ctx, token = _prompt(engine, run, sampler)
        result = engine.forward(run, ctx, _step(token, sampler, steps=11))
        assert [o.token for o in result.outputs] == expected
        assert engine.context_length(run, ctx) == 5 + 11  # the prompt and every step's input
    finally:
        engine.end_run(run)


def test_a_generation_that_stops_inside_a_multi_step_pass_gives_back_the_rest(engine: Engine) -> None:
    run = next(_runs)
    sampler = Sampler()
    try:
        expected = _single_steps(engine, run, sampler, 20)
        ctx, token = _prompt(engine, run, sampler)
        seen: list[int] = []
        lengths: list[int] = []

        def next_step(result: PassResult) -> tuple[int, PassRequest | None]:
            lengths.append(len(result.outputs))
            outputs = [o.token for o in result.outputs]
            if len(seen) + len(outputs) >= 9:  # stop at the 9th token, inside a pass of 8
                used = 9 - len(seen)
                seen.extend(outputs[:used])
                return used, None
            seen.extend(outputs)
            return len(outputs), _step(seen[-1], sampler, steps=8)

        engine.generate(run, ctx, _step(token, sampler, steps=8), next_step)
        assert lengths == [8, 8]
        assert seen == expected[:9]
        # The 9th token is pending: the context holds the prompt, the first input and 8 more.
        assert engine.context_length(run, ctx) == 5 + 9
        # ... so decoding on continues exactly where single steps would.
        after = engine.forward(run, ctx, _step(seen[-1], sampler, steps=3))
        assert [o.token for o in after.outputs] == expected[9:12]
    finally:
        engine.end_run(run)


def test_steps_are_clamped_to_the_free_pages_then_out_of_pages() -> None:
    with Engine.start(EngineConfig("dummy", ["--num-pages", "4", "--page-size", str(PAGE)])) as small:
        run = next(_runs)
        ctx, token = _prompt(small, run, Sampler())  # 5 of the 16 slots
        result = small.forward(run, ctx, _step(token, Sampler(), steps=40))
        assert len(result.outputs) == 11 and small.context_length(run, ctx) == 16
        with pytest.raises(OutOfPages):
            small.forward(run, ctx, _step(result.outputs[-1].token, Sampler(), steps=40))
        small.end_run(run)
        assert small.num_free_pages == 4


@pytest.mark.parametrize(
    "request_",
    [
        PassRequest(tokens=[1, 2], outputs=[OutputSpec(1, Sampler())], steps=4),
        PassRequest(tokens=[1], outputs=[OutputSpec(0, Sampler(), probe=1, probe_k=2)], steps=4),
        PassRequest(tokens=[1], outputs=[OutputSpec(0, Sampler())], steps=4, attention_window=2),
        PassRequest(tokens=[1], outputs=[OutputSpec(0, Sampler())], steps=0),
        PassRequest(tokens=[1], outputs=[OutputSpec(0, Sampler())], steps=65),
    ],
    ids=["two_tokens", "probes", "window", "zero", "too_many"],
)
def test_multi_step_requests_that_are_not_plain_decoding_are_refused(engine: Engine, request_: PassRequest) -> None:
    run = next(_runs)
    try:
        ctx = engine.create_context(run)
        with pytest.raises(InvalidRequest):
            engine.forward(run, ctx, request_)
        assert engine.context_length(run, ctx) == 0
    finally:
        engine.end_run(run)


def test_the_engine_asks_for_several_steps_only_once_passes_are_timed_short() -> None:
    with Engine.start(EngineConfig("dummy", ["--num-pages", "64"])) as fast:
        assert fast.max_decode_steps() == 1  # nothing measured yet
        run = next(_runs)
        _single_steps(fast, run, Sampler(), 4)
        fast_steps = fast.max_decode_steps()
        assert fast_steps > 2  # the dummy answers in well under a millisecond
    with Engine.start(EngineConfig("dummy", ["--num-pages", "64", "--pass-latency-ms", "10"])) as slow:
        _single_steps(slow, next(_runs), Sampler(), 3)
        # 10 ms steps: at most two fit in the default budget of 25 ms (one, when the host's own
        # time per pass passes 2.5 ms on a loaded machine: a bound, not a timing threshold).
        assert 1 <= slow.max_decode_steps() <= 2 < fast_steps
    slow_args = ["--num-pages", "64", "--pass-latency-ms", "10"]
    with Engine.start(EngineConfig("dummy", slow_args, multi_step_budget_ms=10)) as tight:
        _single_steps(tight, next(_runs), Sampler(), 3)
        assert tight.max_decode_steps() == 1  # a 10 ms step already fills a 10 ms budget
    with Engine.start(EngineConfig("dummy", ["--num-pages", "64"], multi_step_budget_ms=0)) as none:
        _single_steps(none, next(_runs), Sampler(), 4)
        assert none.max_decode_steps() == 1  # no budget: one step a pass, however fast
    with Engine.start(EngineConfig("dummy", ["--num-pages", "64"], max_decode_steps=1)) as off:
        _single_steps(off, next(_runs), Sampler(), 4)
        assert off.max_decode_steps() == 1


@pytest.mark.parametrize("depth", [1, 2])
def test_multi_step_generations_and_speculation_interleave(depth: int) -> None:
    """With the speculator on, a context alternates single decode steps (served from staged
    passes, with deferred tokens) and multi-step requests, and a generation stops inside a
    multi-step pass; every token is still what plain single steps give."""
    sampler = Sampler.random(0.9, seed=11)
    with Engine.start(
        EngineConfig("dummy", ["--num-pages", "256", "--page-size", str(PAGE)], speculation_depth=depth)
    ) as e:
        run = next(_runs)
        expected = _single_steps(e, run, sampler, 40)
        ctx, token = _prompt(e, run, sampler)
        got: list[int] = []
        for _ in range(6):  # warm chains: the speculator stages after each plain step
            token = e.forward(run, ctx, _step(token, sampler)).outputs[0].token
            got.append(token)

        def next_step(result: PassResult) -> tuple[int, PassRequest | None]:
            outputs = [o.token for o in result.outputs]
            room = 20 - len(got)
            got.extend(outputs[:room])
            if len(outputs) >= room:
                return room, None
            return len(outputs), _step(got[-1], sampler, steps=6)

        e.generate(run, ctx, _step(token, sampler, steps=6), next_step)
        for _ in range(20):  # plain steps again, after a generation that stopped mid-pass
            token = e.forward(run, ctx, _step(got[-1], sampler)).outputs[0].token
            got.append(token)
        assert got == expected[:40]
        assert e.speculation_stats()["speculation_hits"] > 0  # the single steps were served staged
        e.end_run(run)


def test_a_generations_next_step_runs_with_the_engine_lock_released(engine: Engine) -> None:
    """`next_step` fills grammar masks and writes output: another thread's engine call must not
    wait for it (the lock every run thread needs is not held while it runs)."""
    run = next(_runs)
    served_meanwhile: list[bool] = []

    def next_step(result: PassResult) -> tuple[int, PassRequest | None]:
        other = threading.Thread(target=lambda: engine.num_free_pages)  # takes the engine lock
        other.start()
        other.join(timeout=10)  # a deadlock detector, not a timing: held, it waits for us
        served_meanwhile.append(not other.is_alive())
        done = len(served_meanwhile) == 3
        return len(result.outputs), None if done else _step(result.outputs[-1].token, Sampler())

    try:
        ctx, token = _prompt(engine, run, Sampler())
        engine.generate(run, ctx, _step(token, Sampler()), next_step)
        assert served_meanwhile == [True, True, True]
    finally:
        engine.end_run(run)


def test_a_negative_multi_step_budget_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="multi_step_budget_ms must be >= 0"):
        EngineConfig("dummy", multi_step_budget_ms=-1)
