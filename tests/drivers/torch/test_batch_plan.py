"""`family_keys` (built in numpy for every request at once) gives, per attention family, exactly
the keys and masks of a plain per-request reading of its contract: full attention, a window with
and without sink tokens, user masks, prefill and decode requests in one pass, pages in any order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge_schema.batch import RequestSpec
from drivers.torch.batch_plan import CacheLimits, FamilyKeys, PassPlan, build_plan, family_keys
from tests.drivers.torch.helpers import brle, forward, request

PS = 4
LIMITS = CacheLimits(page_size=PS, num_pages=64, vocab_size=100, max_context=256, max_probe_k=8)


def _reference(plan: PassPlan, window: int, sinks: int) -> dict[str, list[list[object]]]:
    """Per request and query: the key slots it reads, their cache indices, and which it may see."""
    out: dict[str, list[list[object]]] = {"slots": [], "index": [], "allowed": []}
    for r, (kv, nq) in enumerate(zip(plan.kv_len_np.tolist(), plan.num_q_np.tolist(), strict=True)):
        first = max(0, kv - nq - window + 1) if window else 0
        slots = [s for s in range(kv) if s >= first or s < min(sinks, first)]
        pages = plan.page_table_np[r]
        out["slots"].append(slots)
        out["index"].append([int(pages[s // PS]) * PS + s % PS for s in slots])
        rows = []
        for j in range(nq):
            q = kv - nq + j  # the query's own slot
            token = int(plan.q_index_np[r, j])
            user = plan.user_mask[token] if plan.user_mask is not None else None
            rows.append(
                [
                    s <= q and (not window or s > q - window or s < sinks) and (user is None or bool(user[s]))
                    for s in slots
                ]
            )
        out["allowed"].append(rows)
    return out


def _check(fam: FamilyKeys, plan: PassPlan, window: int, sinks: int) -> None:
    want = _reference(plan, window, sinks)
    width = fam.key_slot.shape[1]
    assert width == max([len(s) for s in want["slots"]] + [1])
    for r, slots in enumerate(want["slots"]):
        n = len(slots)
        assert fam.key_slot[r].tolist() == slots + [-1] * (width - n)
        assert fam.key_index[r].tolist() == want["index"][r] + [0] * (width - n)
        for j, row in enumerate(want["allowed"][r]):
            got = fam.mask[r, j].tolist()
            assert got == row + [False] * (width - n), (r, j)
            assert bool(fam.empty[r, j]) == (not any(row))
            assert fam.safe_mask[r, j].tolist() == (got if any(row) else [True] * width)
        padded = fam.mask.shape[1] - len(want["allowed"][r])
        assert not fam.mask[r, len(want["allowed"][r]) :].any() and bool(
            fam.empty[r, -padded:].all() if padded else True
        )


def _pass(seed: int, masked: bool) -> list[RequestSpec]:
    """Prefill chunks and decode steps of 5 contexts on shuffled pages, some rows masked."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(64).tolist()
    specs = []
    for c in range(5):
        start, n = int(rng.integers(0, 30)), int(rng.choice([1, 1, 3, 7]))
        mask_rows = None
        if masked and c % 2:
            mask_rows = [brle((rng.random(start + n) < 0.7).tolist()) for _ in range(n)]
        specs.append(request(rng.integers(0, 100, n).tolist(), start, pages[12 * c :], PS, mask_rows=mask_rows))
    return specs


@pytest.mark.parametrize(("window", "sinks"), [(0, 0), (5, 0), (5, 2), (3, 4)])
@pytest.mark.parametrize("masked", [False, True])
def test_family_keys_equal_a_per_request_reading(window: int, sinks: int, masked: bool) -> None:
    for seed in range(4):
        plan = build_plan(forward(_pass(seed, masked)), LIMITS, torch.device("cpu"))
        _check(family_keys(plan, window, sinks, PS), plan, window, sinks)


def test_family_keys_of_two_decode_steps() -> None:
    plan = build_plan(forward([request([7], 9, [5, 2, 8], PS), request([3], 0, [1], PS)]), LIMITS, torch.device("cpu"))
    fam = family_keys(plan, 0, 0, PS)
    assert fam.key_index.tolist() == [[20, 21, 22, 23, 8, 9, 10, 11, 32, 33], [4] + [0] * 9]
    assert fam.mask.tolist() == [[[True] * 10], [[True] + [False] * 9]]
    _check(fam, plan, 0, 0)
