"""The speculator's one rule table: every feature that forbids staging also forbids serving,
and each rule has a case that fails when the rule is removed.

How each rule was checked: deleting any one `Rule(...)` line from `host.engine.speculator.RULES`
fails `test_every_rule_has_a_feature_case` and that rule's case of
`test_a_feature_that_forbids_staging_also_forbids_serving` (the request is then staged from and
served); for the logit-mask, attention-mask and grammar rules also the named
`test_entry_match_rejects_*` tests below, and end to end tests/host/test_engine_speculation.py
and tests/e2e/test_masks.py (a masked step served from an unmasked staged fire breaks its mask).
Each of those deletions was made and the failures seen before this was written."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge_schema.batch import OutputSpec, Sampler
from bridge_schema.messages import Probe
from host.engine.speculator import (
    RULES,
    RequestShape,
    Speculator,
    StagedEntry,
    entry_matches_request,
    evaluate_request_shape,
    next_entry,
)

SAMPLER = Sampler.random(0.7, top_k=20, seed=3)


def plain(token: int = 5, position: int = 10, **changes: object) -> RequestShape:
    shape = RequestShape(tokens=(token,), position=position, outputs=(OutputSpec(0, SAMPLER),))
    return dataclasses.replace(shape, **changes)


def entry_for(shape: RequestShape) -> StagedEntry:
    return StagedEntry(0, shape.tokens[0], shape.position, shape.outputs[0].sampler, shape.adapter_id)


# One request per rule that carries exactly that feature (and is otherwise plain).
FEATURES: dict[str, RequestShape] = {
    "logit_mask": plain(outputs=(OutputSpec(0, SAMPLER, logit_mask=np.ones(1, np.uint32)),)),
    "grammar": plain(has_grammar=True),
    "attention_mask": plain(has_attention_mask=True),
    "multi_token": plain(tokens=(5, 6), outputs=(OutputSpec(1, SAMPLER),)),
    "sampler_shape": plain(outputs=()),
    "probes": plain(outputs=(OutputSpec(0, SAMPLER, probe=Probe.LOGPROBS, probe_k=2),)),
    "positions": plain(explicit_positions_contiguous=False),
    "multi_step": plain(steps=4),
}


def test_every_rule_has_a_feature_case() -> None:
    assert {rule.reason for rule in RULES} == set(FEATURES)


@pytest.mark.parametrize("reason", sorted(FEATURES))
def test_a_feature_that_forbids_staging_also_forbids_serving(reason: str) -> None:
    shape = FEATURES[reason]
    assert evaluate_request_shape(shape) == reason
    assert entry_matches_request(entry_for(plain()), shape) == reason


@pytest.mark.parametrize(
    "shape",
    [
        plain(tokens=(5, 6), outputs=(OutputSpec(0, SAMPLER),)),  # sampler not on the last row
        plain(outputs=(OutputSpec(0, SAMPLER), OutputSpec(0, SAMPLER))),  # two samplers
        plain(outputs=(OutputSpec(0, SAMPLER, probe=Probe.DISTRIBUTION),)),
    ],
)
def test_other_shapes_are_rejected_on_both_sides(shape: RequestShape) -> None:
    reason = evaluate_request_shape(shape)
    assert reason is not None
    assert entry_matches_request(entry_for(plain()), shape) == reason


def test_multi_token_verify_pass_is_never_served_even_with_the_staged_anchor_first() -> None:
    staged = entry_for(plain(token=5))
    verify = plain(token=5, tokens=(5, 9, 11), outputs=tuple(OutputSpec(i, SAMPLER) for i in range(3)))
    assert entry_matches_request(staged, verify) == "multi_token"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"tokens": (6,)}, "anchor_mismatch"),
        ({"position": 11}, "position_mismatch"),
        ({"outputs": (OutputSpec(0, Sampler.random(0.7, top_k=20, seed=4)),)}, "sampler_mismatch"),
        ({"outputs": (OutputSpec(0, Sampler.greedy()),)}, "sampler_mismatch"),
        ({"adapter_id": 2}, "adapter_mismatch"),
    ],
)
def test_a_staged_entry_serves_only_an_equal_request(change: dict[str, object], reason: str) -> None:
    staged = entry_for(plain())
    assert entry_matches_request(staged, plain()) is None
    assert entry_matches_request(staged, dataclasses.replace(plain(), **change)) == reason  # type: ignore[arg-type]


def test_next_entry_continues_after_the_request() -> None:
    e = next_entry(7, plain(token=5, position=10), sampled_token=42)
    assert (e.anchor, e.position, e.sampler, e.context_id) == (42, 11, SAMPLER, 7)


def test_chain_hit_miss_and_invalidation() -> None:
    spec = Speculator(depth=2)
    first = spec.stage_after(1, plain(token=5, position=10), sampled_token=42)
    assert first is not None
    # The chain already continues past the request: staging after it again would duplicate
    # position 11 (a chain grows from its last entry only).
    assert spec.stage_after(1, plain(token=5, position=10), 42) is None
    second = spec.stage_from_entry(first, 43)
    assert second is not None and second.position == 12
    assert spec.stage_from_entry(second, 44) is None  # chain full at depth 2
    served = spec.take(1, plain(token=42, position=11))
    assert served == first and spec.hits == 1
    assert spec.take(1, plain(token=99, position=12)) is None  # anchor differs: chain dropped
    assert spec.misses["anchor_mismatch"] == 1 and spec.staged(1) == ()
    spec.stage_after(1, plain(), 3)
    assert len(spec.invalidate(1)) == 1 and spec.staged(1) == ()


def test_constrained_requests_are_not_staged_from_and_depth_zero_disables() -> None:
    spec = Speculator(depth=1)
    assert spec.stage_after(1, FEATURES["grammar"], 3) is None and spec.skips["grammar"] == 1
    assert Speculator(depth=0).stage_after(1, plain(), 3) is None


def test_deeper_chain_extends_from_staged_results() -> None:
    spec = Speculator(depth=2)
    e1 = spec.stage_after(1, plain(token=5, position=10), 42)
    assert e1 is not None
    e2 = spec.stage_from_entry(e1, 43)
    assert e2 is not None and (e2.anchor, e2.position) == (43, 12)
    assert spec.stage_from_entry(e2, 44) is None  # depth 2 reached
    assert spec.stage_from_entry(e1, 45) is None  # only the chain's last entry extends it


def test_a_deferred_anchor_matches_nothing_until_resolved() -> None:
    """Staged while the pass it follows is in flight, an entry's anchor is unknown: no request
    may take it until the sampled token is filled in."""
    spec = Speculator(depth=2)
    e1 = spec.stage_after(1, plain(token=5, position=10), None)
    assert e1 is not None and e1.anchor is None
    e2 = spec.stage_from_entry(e1, None)  # deeper, also deferred
    assert e2 is not None and e2.anchor is None and e2.position == 12
    resolved = spec.resolve(e1, 42)
    assert resolved is not None and resolved.anchor == 42 and spec.staged(1) == (resolved, e2)
    assert spec.resolve(e1, 42) is None  # the unresolved entry is gone from the chain
    assert spec.take(1, plain(token=42, position=11)) == resolved
    assert spec.take(1, plain(token=43, position=12)) is None  # e2 still unresolved: a miss
    assert spec.misses["anchor_mismatch"] == 1 and spec.staged(1) == ()


def test_entry_match_rejects_logit_masked_request() -> None:
    staged = entry_for(plain())
    assert entry_matches_request(staged, plain()) is None  # otherwise matching
    masked = plain(outputs=(OutputSpec(0, SAMPLER, logit_mask=np.ones(1, np.uint32)),))
    assert entry_matches_request(staged, masked) == "logit_mask"


def test_entry_match_rejects_user_masked_request() -> None:
    staged = entry_for(plain())
    assert entry_matches_request(staged, plain(has_attention_mask=True)) == "attention_mask"


def test_entry_match_rejects_grammar_request() -> None:
    staged = entry_for(plain())
    assert entry_matches_request(staged, plain(has_grammar=True)) == "grammar"


@st.composite
def request_shapes(draw: st.DrawFn) -> RequestShape:
    n_tokens = draw(st.integers(1, 3))
    rows = draw(st.lists(st.integers(0, n_tokens - 1), max_size=2))
    outputs = tuple(
        OutputSpec(
            row,
            draw(st.sampled_from([SAMPLER, Sampler.greedy(), Sampler.random(0.5, seed=9)])),
            draw(st.sampled_from(list(Probe))),
            draw(st.integers(0, 3)),
            np.ones(1, np.uint32) if draw(st.booleans()) else None,
        )
        for row in rows
    )
    return RequestShape(
        tokens=tuple(draw(st.lists(st.integers(0, 9), min_size=n_tokens, max_size=n_tokens))),
        position=draw(st.integers(0, 50)),
        outputs=outputs,
        adapter_id=draw(st.integers(-1, 2)),
        has_grammar=draw(st.booleans()),
        has_attention_mask=draw(st.booleans()),
        explicit_positions_contiguous=draw(st.booleans()),
    )


@given(request_shapes())
def test_producer_skips_exactly_what_the_consumer_rejects(shape: RequestShape) -> None:
    """For any request: an entry equal to it in anchor, position, sampler and adapter serves it
    if and only if the producer would stage from it, and a refusal names the same feature."""
    sampler = shape.outputs[0].sampler if shape.outputs else SAMPLER
    entry = StagedEntry(0, shape.tokens[0], shape.position, sampler, shape.adapter_id)
    assert entry_matches_request(entry, shape) == evaluate_request_shape(shape)
