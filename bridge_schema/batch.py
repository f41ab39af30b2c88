"""Assemble a `Forward` from per-request pieces and split a `ForwardResult` back per request.

The one place that knows the CSR layout, used by the host's scheduler, drivers' tests and benches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from bridge_schema.messages import Forward, ForwardResult, Probe, SamplerKind


@dataclass(frozen=True, slots=True)
class Sampler:
    """How one output row picks its token. Defaults are greedy."""

    kind: SamplerKind = SamplerKind.GREEDY
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = -1

    @staticmethod
    def greedy() -> Sampler:
        return Sampler()

    @staticmethod
    def random(
        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = -1
    ) -> Sampler:
        return Sampler(SamplerKind.RANDOM, temperature, top_k, top_p, min_p, seed)


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One output row of a request: `row` indexes the request's input tokens."""

    row: int
    sampler: Sampler = Sampler()
    probe: Probe = Probe.NONE
    probe_k: int = 0
    logit_mask: npt.NDArray[np.uint32] | None = None  # ceil(V/32) words, bit j of word i = 32i+j


@dataclass(slots=True)
class RequestSpec:
    """One forward pass of one context, as the host schedules it."""

    context_id: int
    tokens: Sequence[int] | npt.NDArray[np.uint32]
    positions: Sequence[int] | npt.NDArray[np.uint32]
    pages: Sequence[int] | npt.NDArray[np.uint32]
    last_page_len: int
    outputs: Sequence[OutputSpec] = ()
    adapter_id: int = -1
    mask_rows: Sequence[Sequence[int]] | None = None  # BRLE runs per input row, None = causal


@dataclass(slots=True)
class OutputResult:
    token: int
    logprob: float = 0.0
    topk_ids: npt.NDArray[np.uint32] = field(default_factory=lambda: np.zeros(0, np.uint32))
    topk_logprobs: npt.NDArray[np.float32] = field(default_factory=lambda: np.zeros(0, np.float32))
    distribution: npt.NDArray[np.float32] | None = None


def _indptr(counts: Sequence[int]) -> npt.NDArray[np.uint32]:
    out = np.zeros(len(counts) + 1, dtype=np.uint32)
    np.cumsum(counts, out=out[1:])
    return out


def _cat(parts: Sequence[object], dtype: type) -> npt.NDArray[Any]:
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(p, dtype=dtype) for p in parts])


def build_forward(request_id: int, requests: Sequence[RequestSpec]) -> Forward:
    """Pack `requests` into one batch-shaped `Forward`."""
    outputs = [o for r in requests for o in r.outputs]
    masks = [o.logit_mask for o in outputs if o.logit_mask is not None]
    mask_index, k = [], 0
    for o in outputs:
        mask_index.append(-1 if o.logit_mask is None else k)
        k += o.logit_mask is not None
    rows = [row for r in requests if r.mask_rows is not None for row in r.mask_rows]
    return Forward(
        id=request_id,
        context_ids=np.array([r.context_id for r in requests], dtype=np.uint32),
        adapter_ids=np.array([r.adapter_id for r in requests], dtype=np.int32),
        token_indptr=_indptr([len(r.tokens) for r in requests]),
        tokens=_cat([r.tokens for r in requests], np.uint32),
        positions=_cat([r.positions for r in requests], np.uint32),
        page_indptr=_indptr([len(r.pages) for r in requests]),
        pages=_cat([r.pages for r in requests], np.uint32),
        last_page_len=np.array([r.last_page_len for r in requests], dtype=np.uint32),
        mask_req_indptr=_indptr([0 if r.mask_rows is None else len(r.mask_rows) for r in requests]),
        mask_row_indptr=_indptr([len(row) for row in rows]),
        mask_runs=_cat(rows, np.uint32),
        out_indptr=_indptr([len(r.outputs) for r in requests]),
        out_rows=np.array([o.row for o in outputs], dtype=np.uint32),
        sampler=np.array([o.sampler.kind for o in outputs], dtype=np.uint8),
        temperature=np.array([o.sampler.temperature for o in outputs], dtype=np.float32),
        top_k=np.array([o.sampler.top_k for o in outputs], dtype=np.uint32),
        top_p=np.array([o.sampler.top_p for o in outputs], dtype=np.float32),
        min_p=np.array([o.sampler.min_p for o in outputs], dtype=np.float32),
        seed=np.array([o.sampler.seed for o in outputs], dtype=np.int64),
        probe=np.array([o.probe for o in outputs], dtype=np.uint8),
        probe_k=np.array([o.probe_k for o in outputs], dtype=np.uint32),
        logit_mask_index=np.array(mask_index, dtype=np.int32),
        logit_masks=_cat(masks, np.uint32),
    )


def split_result(forward: Forward, result: ForwardResult) -> list[list[OutputResult]]:
    """Per request of `forward`, the results of its output rows in order."""
    entries: list[OutputResult] = []
    for i in range(len(result.tokens)):
        k0, k1 = int(result.topk_indptr[i]), int(result.topk_indptr[i + 1])
        d0, d1 = int(result.dist_indptr[i]), int(result.dist_indptr[i + 1])
        entries.append(
            OutputResult(
                token=int(result.tokens[i]),
                logprob=float(result.logprobs[i]),
                topk_ids=result.topk_ids[k0:k1],
                topk_logprobs=result.topk_logprobs[k0:k1],
                distribution=result.dists[d0:d1] if d1 > d0 else None,
            )
        )
    bounds = forward.out_indptr
    return [entries[int(bounds[r]) : int(bounds[r + 1])] for r in range(forward.num_requests)]


def logit_mask_words(vocab_size: int) -> int:
    """Number of u32 words in one logit mask."""
    return (vocab_size + 31) // 32


def pack_allowed(vocab_size: int, allowed: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.uint32]:
    """A logit mask allowing exactly the token ids in `allowed`."""
    bits = np.zeros(logit_mask_words(vocab_size) * 32, dtype=np.uint8)
    bits[np.asarray(allowed, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


def unpack_allowed(vocab_size: int, mask: npt.NDArray[np.uint32]) -> npt.NDArray[np.bool_]:
    """Boolean [vocab_size] view of a logit mask."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<u4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)
