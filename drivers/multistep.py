"""Multi-step requests (the "multi_step" capability), run by the serve loop for every driver.

A request with `Forward.steps[r] = N > 1` is N decode steps of one context in one request (see
`bridge_schema.messages.Forward`). This module runs such a Forward as N passes through the
driver's own `forward`: the first pass is the Forward itself with each multi-step request cut
to its first step; pass j > 0 runs the requests still going, each on the token its previous
step sampled, one position and one KV slot further on. The results are put back together in
the Forward's output order. The host pays one round trip for N tokens; the driver runs each
step as it would any decode pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from bridge_schema.messages import Forward, ForwardResult
from drivers.sampler_chain import take_outputs

# Per-output fields of `Forward` that a later step copies from the request's output of that step.
_SAMPLER_FIELDS = ("sampler", "temperature", "top_k", "top_p", "min_p", "seed")


def run_steps(forward: Callable[[Forward], ForwardResult], f: Forward, page_size: int) -> ForwardResult:
    """`forward(f)`, with `f`'s multi-step requests run step by step."""
    if not len(f.steps) or int(f.steps.max()) == 1:
        return forward(f)
    steps = f.steps.astype(np.int64)
    out_ptr = f.out_indptr.astype(np.int64)
    page_ptr = f.page_indptr.astype(np.int64)
    kv_len = (page_ptr[1:] - page_ptr[:-1] - 1) * page_size + f.last_page_len.astype(np.int64)
    num_out = len(f.out_rows)
    multi = np.flatnonzero(steps > 1)
    is_step0 = np.ones(num_out, dtype=bool)  # outputs the first pass produces
    for r in multi.tolist():
        is_step0[out_ptr[r] + 1 : out_ptr[r + 1]] = False
    first = _first_pass(f, steps, kv_len, page_ptr, is_step0, page_size)
    result0 = forward(first)
    tokens = np.zeros(num_out, dtype=np.int32)
    logprobs = np.zeros(num_out, dtype=np.float32)
    tokens[is_step0] = result0.tokens
    logprobs[is_step0] = result0.logprobs
    active = multi
    first_pos = f.positions[f.token_indptr[:-1]].astype(np.int64)
    for j in range(1, int(steps.max())):
        active = active[steps[active] > j]
        outputs = out_ptr[active] + j
        previous = tokens[outputs - 1].astype(np.uint32)
        step = _later_pass(f, active, j, outputs, previous, first_pos, kv_len - (steps - 1 - j), page_ptr, page_size)
        result = forward(step)
        tokens[outputs] = result.tokens
        logprobs[outputs] = result.logprobs
    return ForwardResult(
        id=f.id,
        tokens=tokens,
        logprobs=logprobs,
        topk_indptr=_spread(result0.topk_indptr, is_step0),
        topk_ids=result0.topk_ids,
        topk_logprobs=result0.topk_logprobs,
        dist_indptr=_spread(result0.dist_indptr, is_step0),
        dists=result0.dists,
    )


def _pages(
    f: Forward, requests: npt.NDArray[np.int64], kv: npt.NDArray[np.int64], page_ptr: npt.NDArray[np.int64], ps: int
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
    """(page_indptr, pages, last_page_len) of `requests` when their KV holds `kv` slots."""
    n_pages = (kv + ps - 1) // ps
    indptr = np.zeros(len(requests) + 1, dtype=np.uint32)
    np.cumsum(n_pages, out=indptr[1:])
    parts = [f.pages[page_ptr[r] : page_ptr[r] + n] for r, n in zip(requests.tolist(), n_pages.tolist(), strict=True)]
    pages = np.concatenate(parts).astype(np.uint32) if parts else np.zeros(0, np.uint32)
    return indptr, pages, (kv - (n_pages - 1) * ps).astype(np.uint32)


def _first_pass(
    f: Forward,
    steps: npt.NDArray[np.int64],
    kv_len: npt.NDArray[np.int64],
    page_ptr: npt.NDArray[np.int64],
    is_step0: npt.NDArray[np.bool_],
    ps: int,
) -> Forward:
    """`f` with each multi-step request cut to its first step (one output, its first KV slot)."""
    everyone = np.arange(len(steps))
    page_indptr, pages, last_page_len = _pages(f, everyone, kv_len - (steps - 1), page_ptr, ps)
    out_counts = np.where(steps > 1, 1, np.diff(f.out_indptr.astype(np.int64)))
    out_indptr = np.zeros(len(steps) + 1, dtype=np.uint32)
    np.cumsum(out_counts, out=out_indptr[1:])
    per_output = {
        name: getattr(f, name)[is_step0]
        for name in ("out_rows", *_SAMPLER_FIELDS, "probe", "probe_k", "logit_mask_index")
    }
    per_output.update(take_outputs(f, np.flatnonzero(is_step0)))
    if len(f.score_tokens):
        per_output["score_tokens"] = f.score_tokens[is_step0]
    return Forward(
        id=f.id,
        context_ids=f.context_ids,
        adapter_ids=f.adapter_ids,
        token_indptr=f.token_indptr,
        tokens=f.tokens,
        positions=f.positions,
        page_indptr=page_indptr,
        pages=pages,
        last_page_len=last_page_len,
        mask_req_indptr=f.mask_req_indptr,
        mask_row_indptr=f.mask_row_indptr,
        mask_runs=f.mask_runs,
        out_indptr=out_indptr,
        logit_masks=f.logit_masks,
        deferred=f.deferred,
        **per_output,
    )


def _later_pass(
    f: Forward,
    active: npt.NDArray[np.int64],
    j: int,
    outputs: npt.NDArray[np.int64],
    previous: npt.NDArray[np.uint32],
    first_pos: npt.NDArray[np.int64],
    kv_len: npt.NDArray[np.int64],
    page_ptr: npt.NDArray[np.int64],
    ps: int,
) -> Forward:
    """Step `j` of the `active` multi-step requests: each runs the token its step j-1 sampled."""
    n = len(active)
    ones = np.arange(n + 1, dtype=np.uint32)
    page_indptr, pages, last_page_len = _pages(f, active, kv_len[active], page_ptr, ps)
    return Forward(
        id=f.id,
        context_ids=f.context_ids[active],
        adapter_ids=f.adapter_ids[active],
        token_indptr=ones,
        tokens=previous,
        positions=(first_pos[active] + j).astype(np.uint32),
        page_indptr=page_indptr,
        pages=pages,
        last_page_len=last_page_len,
        mask_req_indptr=np.zeros(n + 1, dtype=np.uint32),
        mask_row_indptr=np.zeros(1, dtype=np.uint32),
        out_indptr=ones,
        out_rows=np.zeros(n, dtype=np.uint32),
        probe=np.zeros(n, dtype=np.uint8),
        probe_k=np.zeros(n, dtype=np.uint32),
        logit_mask_index=np.full(n, -1, dtype=np.int32),
        **{name: getattr(f, name)[outputs] for name in _SAMPLER_FIELDS},
        **take_outputs(f, outputs),
    )


def _spread(indptr: npt.NDArray[np.uint32], present: npt.NDArray[np.bool_]) -> npt.NDArray[np.uint32]:
    """An indptr over the outputs where `present`, widened to every output (the others empty)."""
    counts = np.zeros(len(present), dtype=np.int64)
    counts[present] = np.diff(indptr.astype(np.int64))
    out = np.zeros(len(present) + 1, dtype=np.uint32)
    np.cumsum(counts, out=out[1:])
    return out
