"""Pass-level speculation inside the engine, on the real dummy driver (over loopback, which
still encodes every frame): staged decodes serve plain steps, never constrained ones, and
never change what a run generates."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from bridge_schema.batch import OutputSpec, Sampler, pack_allowed, unpack_allowed
from host.engine import Engine, EngineConfig
from host.services import PassRequest

PAGE = 4
_runs = itertools.count(1000)
SEEDED = Sampler.random(seed=11)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.start(
        EngineConfig("loopback", ["--num-pages", "256", "--page-size", str(PAGE)], speculation_depth=1)
    ) as e:
        yield e


@pytest.fixture(scope="module")
def cold_engine() -> Iterator[Engine]:
    with Engine.start(
        EngineConfig("loopback", ["--num-pages", "256", "--page-size", str(PAGE)], speculation_depth=0)
    ) as e:
        yield e


def step(engine: Engine, run: int, ctx: int, tokens: list[int], sampler: Sampler = SEEDED, **kw: object) -> int:
    outputs = [OutputSpec(len(tokens) - 1, sampler, logit_mask=kw.pop("logit_mask", None))]  # type: ignore[arg-type]
    return engine.forward(run, ctx, PassRequest(tokens=tokens, outputs=outputs, **kw)).outputs[0].token  # type: ignore[arg-type]


def generate(engine: Engine, n: int) -> list[int]:
    run = next(_runs)
    ctx = engine.create_context(run)
    tokens = [step(engine, run, ctx, [72, 105, 33])]
    for _ in range(n):
        tokens.append(step(engine, run, ctx, [tokens[-1]]))
    assert engine.context_length(run, ctx) == 3 + n
    engine.end_run(run)
    return tokens


def stats_delta(engine: Engine, before: dict[str, int]) -> dict[str, int]:
    after = engine.speculation_stats()
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def test_plain_decodes_are_served_from_staged_passes_without_changing_the_output(
    engine: Engine, cold_engine: Engine
) -> None:
    before = engine.speculation_stats()
    speculative = generate(engine, 40)
    delta = stats_delta(engine, before)
    # Every decode step but the first: a prefill is multi-token, which the table forbids staging from.
    assert delta["speculation_hits"] == 39
    assert speculative == generate(cold_engine, 40)
    assert cold_engine.speculation_stats()["speculation_hits"] == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_steps_sent_before_their_input_token_is_back_generate_the_same(depth: int, cold_engine: Engine) -> None:
    """With deferred tokens, each next step goes to the driver while the pass it follows is in
    flight, its input token left for the driver to fill in. The dummy's greedy draw depends on
    its input token, so a wrong or stale token would change what is generated."""
    greedy = Sampler.greedy()

    def run_greedy(e: Engine) -> list[int]:
        run = next(_runs)
        ctx = e.create_context(run)
        tokens = [step(e, run, ctx, [72, 105, 33], greedy)]
        for _ in range(30):
            tokens.append(step(e, run, ctx, [tokens[-1]], greedy))
        e.end_run(run)
        return tokens

    args = ["--num-pages", "256", "--page-size", str(PAGE)]
    with Engine.start(EngineConfig("loopback", args, speculation_depth=depth)) as e:
        pipelined = run_greedy(e)
        assert e.speculation_stats()["speculation_hits"] == 29  # all but the step after the prompt
        # Steps staged before their input token was back (how many depends on timing: a step staged
        # after its pass already returned carries its token).
        assert e.driver_health()["deferred_tokens_filled"] > 0
    assert len(set(pipelined)) > 3  # the draws depend on the token (else this proves nothing)
    assert pipelined == run_greedy(cold_engine)


def test_a_request_with_a_logit_mask_is_never_served_by_a_staged_fire(engine: Engine) -> None:
    run = next(_runs)
    ctx = engine.create_context(run)
    allowed = [ord(c) for c in "{}[]"]
    mask = pack_allowed(engine.model.vocab_size, allowed)
    before = engine.speculation_stats()
    token = step(engine, run, ctx, [65, 66])  # a prefill stages nothing (multi-token)
    token = step(engine, run, ctx, [token])  # a plain decode: stages an unconstrained next step
    for _ in range(30):
        token = step(engine, run, ctx, [token], logit_mask=mask)
        assert token in allowed  # a staged, unmasked result would almost surely fall outside
        token = step(engine, run, ctx, [token])  # plain again: stages once more
    delta = stats_delta(engine, before)
    assert delta["speculation_miss_logit_mask"] == 30
    assert unpack_allowed(engine.model.vocab_size, mask).sum() == 4
    engine.end_run(run)


def test_a_request_with_an_attention_mask_is_never_served_by_a_staged_fire(engine: Engine) -> None:
    run = next(_runs)
    ctx = engine.create_context(run)
    token = step(engine, run, ctx, [65, 66, 67])
    token = step(engine, run, ctx, [token])  # stages the next step
    before = engine.speculation_stats()
    for _ in range(5):
        kv = engine.context_length(run, ctx) + 1
        window = [kv - 2, 2]  # attend to the last two keys only
        token = step(engine, run, ctx, [token], mask_rows=[window])
        token = step(engine, run, ctx, [token])
    delta = stats_delta(engine, before)
    assert delta["speculation_miss_attention_mask"] == 5
    assert delta["speculation_skip_attention_mask"] == 5  # and masked steps stage nothing
    engine.end_run(run)


def test_a_changed_sampler_is_not_served_the_staged_result(engine: Engine, cold_engine: Engine) -> None:
    def run_with_switch(e: Engine) -> list[int]:
        run = next(_runs)
        ctx = e.create_context(run)
        out = [step(e, run, ctx, [70, 71])]
        for i in range(12):
            out.append(step(e, run, ctx, [out[-1]], Sampler.random(seed=100 + i % 3)))
        e.end_run(run)
        return out

    before = engine.speculation_stats()
    assert run_with_switch(engine) == run_with_switch(cold_engine)
    assert stats_delta(engine, before).get("speculation_miss_sampler_mismatch", 0) >= 8


def test_truncate_and_fork_invalidate_the_chain(engine: Engine, cold_engine: Engine) -> None:
    def scenario(e: Engine) -> list[int]:
        run = next(_runs)
        ctx = e.create_context(run)
        out = [step(e, run, ctx, [80, 81, 82])]
        out.append(step(e, run, ctx, [out[-1]]))
        e.truncate_context(run, ctx, 3)  # rewind: the staged step is for a position that no longer follows
        out.append(step(e, run, ctx, [out[0]]))
        child = e.fork_context(run, ctx)
        out.append(step(e, run, child, [out[-1]]))
        out.append(step(e, run, ctx, [out[-2]]))
        assert e.context_length(run, ctx) == e.context_length(run, child) == 5
        e.end_run(run)
        return out

    assert scenario(engine) == scenario(cold_engine)


def test_ending_a_run_with_staged_passes_frees_every_page(engine: Engine) -> None:
    free = engine.num_free_pages
    run = next(_runs)
    contexts = [engine.create_context(run) for _ in range(8)]
    for ctx in contexts:
        token = step(engine, run, ctx, [1, 2, 3, 4])  # a full page: the staged step reserves a new one
        step(engine, run, ctx, [token])
    engine.end_run(run)
    assert engine.num_free_pages == free


def test_positions_continue_after_served_steps(engine: Engine) -> None:
    run = next(_runs)
    ctx = engine.create_context(run)
    token = step(engine, run, ctx, [5, 6])
    for _ in range(6):
        token = step(engine, run, ctx, [token])
    explicit = engine.forward(run, ctx, PassRequest(tokens=[token], positions=[8], outputs=[OutputSpec(0, SEEDED)]))
    assert len(explicit.outputs) == 1 and engine.context_length(run, ctx) == 9
    _ = np  # numpy is imported for the mask helpers' arrays
    engine.end_run(run)


def test_a_rewind_drops_the_staged_step_even_when_the_next_request_looks_identical(engine: Engine) -> None:
    """After truncating by one, a request with the staged anchor and position would match the
    staged entry, but that entry wrote its KV one slot further on: it must not be served."""
    run = next(_runs)
    ctx = engine.create_context(run)
    first = step(engine, run, ctx, [90, 91])
    anchor = step(engine, run, ctx, [first])  # stages (anchor, position 3)
    engine.truncate_context(run, ctx, 2)
    before = engine.speculation_stats()
    step(engine, run, ctx, [anchor], positions=[3])  # same anchor and position, one slot earlier
    assert stats_delta(engine, before).get("speculation_hits", 0) == 0
    assert engine.context_length(run, ctx) == 3
    engine.end_run(run)


def test_a_grammar_request_is_never_served_even_when_its_matcher_allows_every_token(engine: Engine) -> None:
    run = next(_runs)
    ctx = engine.create_context(run)
    token = step(engine, run, ctx, [65, 66])
    token = step(engine, run, ctx, [token])  # stages the next step
    before = engine.speculation_stats()
    token = step(engine, run, ctx, [token], has_grammar=True)  # no logit mask: the matcher allowed all
    delta = stats_delta(engine, before)
    assert delta.get("speculation_hits", 0) == 0 and delta["speculation_miss_grammar"] == 1
    assert delta["speculation_skip_grammar"] == 1  # and nothing is staged from it
    engine.end_run(run)


CHAINS = {
    "logit_bias": {"logit_bias": ((65, 3.0), (66, 2.0), (200, -100.0))},
    "repetition": {"repetition_penalty": 1.5},
    "presence": {"presence_penalty": 2.0, "penalty_from": 3},
    "frequency": {"frequency_penalty": 0.5, "penalty_last_n": 6},
    "windows": {"frequency_penalty": 0.7, "repetition_penalty": 1.2, "repetition_from": 1, "penalty_from": 2},
    "mirostat": {"mirostat_tau": 7.9, "mirostat_eta": 0.5},
    "dry": {"dry_multiplier": 0.8, "dry_allowed_length": 1, "dry_breakers": (10,)},
}


@pytest.mark.parametrize("stage", sorted(CHAINS))
def test_chains_are_pre_fired_when_equal_and_refused_when_not(stage: str, cold_engine: Engine) -> None:
    """A sampler chain is deterministic given the tokens in the context's slots (which the driver
    keeps, staged ones included), so staged steps with the chain serve the next steps; a step
    whose chain differs in the stage is refused the staged result. Either way the tokens equal
    those of an engine that stages nothing."""
    with_chain = dataclasses.replace(Sampler.random(seed=21), **CHAINS[stage])  # type: ignore[arg-type]
    changed = {name: (value[:1] if name == "logit_bias" else value * 2) for name, value in CHAINS[stage].items()}
    other = dataclasses.replace(with_chain, **changed)  # type: ignore[arg-type]

    def scenario(e: Engine, samplers: list[Sampler]) -> list[int]:
        run = next(_runs)
        ctx = e.create_context(run)
        tokens = [step(e, run, ctx, [72, 105, 33], samplers[0])]
        for s in samplers[1:]:
            tokens.append(step(e, run, ctx, [tokens[-1]], s))
        e.end_run(run)
        return tokens

    args = ["--num-pages", "256", "--page-size", str(PAGE)]
    with Engine.start(EngineConfig("loopback", args, speculation_depth=1)) as e:
        same = [with_chain] * 16
        before = e.speculation_stats()
        assert scenario(e, same) == scenario(cold_engine, same)
        delta = stats_delta(e, before)
        assert delta["speculation_hits"] == 14, delta  # every single-token step but the first
        switching = [with_chain if i % 2 else other for i in range(16)]
        before = e.speculation_stats()
        assert scenario(e, switching) == scenario(cold_engine, switching)
        delta = stats_delta(e, before)
        assert delta["speculation_miss_sampler_mismatch"] == 14 and not delta.get("speculation_hits"), delta


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_penalties_count_the_tokens_of_staged_steps(depth: int) -> None:
    """Steps sent before their input token is back: the driver writes each deferred token into
    its slot before the penalties count it. The dummy's scripted logits make the greedy text
    exact: with a presence penalty of 1, a (3), b (2.6), c (2.2), then a (2) for good."""
    a, b, c = ord("a"), ord("b"), ord("c")
    args = ["--num-pages", "256", "--page-size", str(PAGE), "--logits", "a=3,b=2.6,c=2.2"]
    presence = dataclasses.replace(Sampler.greedy(), presence_penalty=1.0, penalty_from=3)
    with Engine.start(EngineConfig("loopback", args, speculation_depth=depth)) as e:
        run = next(_runs)
        ctx = e.create_context(run)
        tokens = [step(e, run, ctx, [72, 105, 33], presence)]
        for _ in range(7):
            tokens.append(step(e, run, ctx, [tokens[-1]], presence))
        assert tokens == [a, b, c, a, a, a, a, a]
        assert e.speculation_stats()["speculation_hits"] == (6 if depth else 0)
