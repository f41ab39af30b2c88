"""`drivers.deferred.DeferredTokens` on its own: which token a deferred request continues from,
for one-output decode passes and the rest, and what it keeps within its bound."""

from __future__ import annotations

import numpy as np
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward
from bridge_schema.messages import Forward, ForwardResult
from drivers.deferred import DeferredTokens
from drivers.errors import RequestRejected

GREEDY = Sampler.greedy()


def _pass(contexts: list[int], outputs_per_request: list[int] | None = None) -> Forward:
    outputs_per_request = outputs_per_request or [1] * len(contexts)
    specs = [
        RequestSpec(ctx, [1, 2, 3], [0, 1, 2], [i], 3, [OutputSpec(row, GREEDY) for row in range(3 - n, 3)])
        for i, (ctx, n) in enumerate(zip(contexts, outputs_per_request, strict=True))
    ]
    return build_forward(0, specs)


def _result(tokens: list[int]) -> ForwardResult:
    o = len(tokens)
    return ForwardResult(
        tokens=np.array(tokens, dtype=np.int32),
        logprobs=np.zeros(o, np.float32),
        topk_indptr=np.zeros(o + 1, np.uint32),
        dist_indptr=np.zeros(o + 1, np.uint32),
    )


def _continue(store: DeferredTokens, ctx: int) -> int:
    step = build_forward(0, [RequestSpec(ctx, [0], [3], [0], 4, [OutputSpec(0, GREEDY)], deferred=True)])
    return int(store.resolve(step).tokens[0])


def test_a_one_output_pass_records_each_requests_token() -> None:
    store = DeferredTokens()
    store.record(_pass([5, 6, 7]), _result([50, 60, 70]))
    assert [_continue(store, c) for c in (5, 6, 7)] == [50, 60, 70]


def test_the_last_output_of_each_request_is_recorded_and_requests_without_one_are_skipped() -> None:
    store = DeferredTokens()
    store.record(_pass([5, 6, 7], [2, 0, 3]), _result([1, 50, 2, 3, 70]))
    assert _continue(store, 5) == 50 and _continue(store, 7) == 70
    with pytest.raises(RequestRejected, match="context 6"):
        _continue(store, 6)


def test_a_later_record_replaces_an_older_one_across_generations() -> None:
    store = DeferredTokens(max_contexts=4)
    store.record(_pass([1, 2]), _result([10, 20]))  # a full generation: it becomes the older one
    store.record(_pass([1]), _result([11]))
    assert _continue(store, 1) == 11 and _continue(store, 2) == 20


def test_the_most_recent_half_of_the_budget_is_always_kept() -> None:
    budget = 8
    store = DeferredTokens(max_contexts=budget)
    for ctx in range(100):
        store.record(_pass([ctx]), _result([ctx + 1000]))
        for recent in range(max(0, ctx - budget // 2 + 1), ctx + 1):
            assert _continue(store, recent) == recent + 1000
    with pytest.raises(RequestRejected):  # long evicted
        _continue(store, 0)


def test_forget_drops_a_context_from_both_generations() -> None:
    store = DeferredTokens(max_contexts=4)
    store.record(_pass([1, 2]), _result([10, 20]))
    store.record(_pass([1]), _result([11]))
    store.forget(_pass([1]))
    with pytest.raises(RequestRejected, match="context 1"):
        _continue(store, 1)
    assert _continue(store, 2) == 20
