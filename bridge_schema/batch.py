"""Assemble a `Forward` from per-request pieces and split a `ForwardResult` back per request.

The one place that knows the CSR layout, used by the host's scheduler, drivers' tests and benches.
"""

from __future__ import annotations

import itertools
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
    # The chain's stages before the sampler (`Forward`'s "Sampler chain"): penalties over the
    # context's tokens from slot `penalty_from` (presence, frequency) and `repetition_from`
    # (repetition), only the last `penalty_last_n` (0 = all); a logit bias per token.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_from: int = 0
    repetition_from: int = 0
    penalty_last_n: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias), tokens strictly increasing
    # Random rows' filters besides top-k, top-p and min-p (`Forward`'s "Sampler chain").
    typical_p: float = 1.0
    top_n_sigma: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat_tau: float = 0.0
    mirostat_eta: float = 0.1
    # DRY (`Forward`'s "Sampler chain"; llama.cpp's defaults), off at multiplier 0; its sequence
    # breakers are token ids.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_last_n: int = 0
    dry_breakers: tuple[int, ...] = ()
    # Worked out once, at construction: `build_forward` reads them for every output of a pass.
    has_penalties: bool = field(init=False, compare=False, repr=False)
    has_filters: bool = field(init=False, compare=False, repr=False)
    has_chain: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        penalties = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        filters = (
            self.typical_p != 1.0 or self.top_n_sigma != 0.0 or self.xtc_probability != 0.0 or self.mirostat_tau != 0.0
        )
        object.__setattr__(self, "has_penalties", penalties)
        object.__setattr__(self, "has_filters", filters)
        object.__setattr__(self, "has_chain", penalties or filters or bool(self.logit_bias) or self.has_dry)

    @property
    def has_dry(self) -> bool:
        return self.dry_multiplier != 0.0

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
    score_token: int = -1  # with LOGPROBS: report this token's logprob, not the sampled one's


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
    # True: the first token is the one the driver last sampled for this context (`tokens[0]` is
    # sent as 0; see `Forward`); needs the driver's "deferred_tokens" capability.
    deferred: bool = False
    # More than 1: a multi-step request (one token, one output per step on rows 0..steps-1; see
    # `Forward`); needs the driver's "multi_step" capability.
    steps: int = 1


_NO_IDS: npt.NDArray[np.uint32] = np.zeros(0, np.uint32)
_NO_LOGPROBS: npt.NDArray[np.float32] = np.zeros(0, np.float32)
_NO_STEPS: npt.NDArray[np.uint32] = np.zeros(0, np.uint32)
_NO_SCORES: npt.NDArray[np.int32] = np.zeros(0, np.int32)
_NO_IDS.flags.writeable = _NO_LOGPROBS.flags.writeable = _NO_STEPS.flags.writeable = False
_NO_SCORES.flags.writeable = False


@dataclass(slots=True)
class OutputResult:
    token: int
    logprob: float = 0.0
    # Shared read-only empties: most outputs carry no probes, and allocating per output costs.
    topk_ids: npt.NDArray[np.uint32] = field(default_factory=lambda: _NO_IDS)
    topk_logprobs: npt.NDArray[np.float32] = field(default_factory=lambda: _NO_LOGPROBS)
    distribution: npt.NDArray[np.float32] | None = None


def _indptr(counts: Sequence[int]) -> npt.NDArray[np.uint32]:
    # Summed in Python: numpy's cumsum of a short list costs more in conversion than it saves.
    return np.fromiter(itertools.accumulate(counts, initial=0), dtype=np.uint32, count=len(counts) + 1)


def _cat(parts: Sequence[object], dtype: type) -> npt.NDArray[Any]:
    if not parts:
        return np.zeros(0, dtype=dtype)
    if len(parts) == 1:
        return np.asarray(parts[0], dtype=dtype)
    # Converted in C, part by part; ranges are the decoder's job on the other side.
    joined: npt.NDArray[Any] = np.concatenate(parts, dtype=dtype, casting="unsafe")  # type: ignore[call-overload]
    return joined


# The per-output fields of `Forward`, in the order `build_forward` gathers them: (field, dtype).
_OUTPUT_COLUMNS: tuple[tuple[str, type], ...] = (
    ("out_rows", np.uint32),
    ("sampler", np.uint8),
    ("temperature", np.float32),
    ("top_k", np.uint32),
    ("top_p", np.float32),
    ("min_p", np.float32),
    ("seed", np.int64),
    ("probe", np.uint8),
    ("probe_k", np.uint32),
    ("logit_mask_index", np.int32),
)


def build_forward(request_id: int, requests: Sequence[RequestSpec]) -> Forward:
    """Pack `requests` into one batch-shaped `Forward`."""
    outputs = [o for r in requests for o in r.outputs]
    masks: list[npt.NDArray[np.uint32]] = []
    rows_of_outputs: list[tuple[Any, ...]] = []
    for o in outputs:
        s = o.sampler
        mask_index = -1
        if o.logit_mask is not None:
            mask_index = len(masks)
            masks.append(o.logit_mask)
        rows_of_outputs.append(
            (o.row, s.kind, s.temperature, s.top_k, s.top_p, s.min_p, s.seed, o.probe, o.probe_k, mask_index)
        )
    columns = list(zip(*rows_of_outputs, strict=True)) if outputs else [()] * len(_OUTPUT_COLUMNS)
    per_output: dict[str, npt.NDArray[Any]] = {
        name: np.array(col, dtype=dtype) for (name, dtype), col in zip(_OUTPUT_COLUMNS, columns, strict=True)
    }
    mask_rows = [row for r in requests if r.mask_rows is not None for row in r.mask_rows]
    per_request = [
        (r.context_id, r.adapter_id, len(r.tokens), len(r.pages), r.last_page_len, len(r.outputs)) for r in requests
    ]
    context_ids, adapter_ids, n_tokens, n_pages, last_page_len, n_outputs = zip(*per_request, strict=True)
    return Forward(
        id=request_id,
        context_ids=np.array(context_ids, dtype=np.uint32),
        adapter_ids=np.array(adapter_ids, dtype=np.int32),
        token_indptr=_indptr(n_tokens),
        tokens=_cat([r.tokens for r in requests], np.uint32),
        positions=_cat([r.positions for r in requests], np.uint32),
        page_indptr=_indptr(n_pages),
        pages=_cat([r.pages for r in requests], np.uint32),
        last_page_len=np.array(last_page_len, dtype=np.uint32),
        mask_req_indptr=_indptr([0 if r.mask_rows is None else len(r.mask_rows) for r in requests]),
        mask_row_indptr=_indptr([len(row) for row in mask_rows]),
        mask_runs=_cat(mask_rows, np.uint32),
        out_indptr=_indptr(n_outputs),
        logit_masks=_cat(masks, np.uint32),
        deferred=np.array([i for i, r in enumerate(requests) if r.deferred], dtype=np.uint32),
        steps=np.array([r.steps for r in requests], dtype=np.uint32)
        if any(r.steps != 1 for r in requests)
        else _NO_STEPS,
        score_tokens=np.array([o.score_token for o in outputs], dtype=np.int32)
        if any(o.score_token >= 0 for o in outputs)
        else _NO_SCORES,
        **per_output,
        **(_chain_columns([o.sampler for o in outputs]) if any(o.sampler.has_chain for o in outputs) else {}),
    )


def _chain_columns(samplers: list[Sampler]) -> dict[str, npt.NDArray[Any]]:
    """The sampler chain's columns of a `Forward`: none when no sampler has penalties or a bias."""
    columns: dict[str, npt.NDArray[Any]] = {}
    if any(s.has_penalties for s in samplers):
        penalties = [
            (
                s.repetition_penalty,
                s.presence_penalty,
                s.frequency_penalty,
                s.penalty_from,
                s.repetition_from,
                s.penalty_last_n,
            )
            for s in samplers
        ]
        for (name, dtype), column in zip(PENALTY_COLUMNS, zip(*penalties, strict=True), strict=True):
            columns[name] = np.array(column, dtype=dtype)
    if any(s.has_filters for s in samplers):
        filters = [
            (s.typical_p, s.top_n_sigma, s.xtc_probability, s.xtc_threshold, s.mirostat_tau, s.mirostat_eta)
            for s in samplers
        ]
        for name, column in zip(FILTER_COLUMNS, zip(*filters, strict=True), strict=True):
            columns[name] = np.array(column, dtype=np.float32)
    if any(s.has_dry for s in samplers):
        dry = [(s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_last_n) for s in samplers]
        for (name, dtype), column in zip(DRY_COLUMNS, zip(*dry, strict=True), strict=True):
            columns[name] = np.array(column, dtype=dtype)
        columns["dry_breaker_indptr"] = _indptr([len(s.dry_breakers) for s in samplers])
        columns["dry_breaker_ids"] = np.array([t for s in samplers for t in s.dry_breakers], dtype=np.uint32)
    if any(s.logit_bias for s in samplers):
        pairs = [pair for s in samplers for pair in s.logit_bias]
        columns["logit_bias_indptr"] = _indptr([len(s.logit_bias) for s in samplers])
        columns["logit_bias_ids"] = np.array([t for t, _ in pairs], dtype=np.uint32)
        columns["logit_bias"] = np.array([b for _, b in pairs], dtype=np.float32)
    return columns


# The random rows' filter columns of `Forward` (all [O] float32, or all empty).
FILTER_COLUMNS = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "mirostat_tau", "mirostat_eta")
# The penalty columns of `Forward` (all [O], or all empty): (field, dtype).
PENALTY_COLUMNS: tuple[tuple[str, type], ...] = (
    ("repetition_penalty", np.float32),
    ("presence_penalty", np.float32),
    ("frequency_penalty", np.float32),
    ("penalty_from", np.uint32),
    ("repetition_from", np.uint32),
    ("penalty_last_n", np.uint32),
)


# DRY's per-output columns of `Forward` (all [O], or all empty), beside its breakers' CSR.
DRY_COLUMNS: tuple[tuple[str, type], ...] = (
    ("dry_multiplier", np.float32),
    ("dry_base", np.float32),
    ("dry_allowed_length", np.uint32),
    ("dry_last_n", np.uint32),
)


def split_result(forward: Forward, result: ForwardResult) -> list[list[OutputResult]]:
    """Per request of `forward`, the results of its output rows in order."""
    tokens, logprobs = result.tokens.tolist(), result.logprobs.tolist()
    if not len(result.topk_ids) and not len(result.dists):  # no probes: no slicing per output
        entries = [OutputResult(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]
    else:
        topk, dist = result.topk_indptr.tolist(), result.dist_indptr.tolist()
        entries = [
            OutputResult(
                token=tokens[i],
                logprob=logprobs[i],
                topk_ids=result.topk_ids[topk[i] : topk[i + 1]],
                topk_logprobs=result.topk_logprobs[topk[i] : topk[i + 1]],
                distribution=result.dists[dist[i] : dist[i + 1]] if dist[i + 1] > dist[i] else None,
            )
            for i in range(len(tokens))
        ]
    bounds = forward.out_indptr.tolist()
    return [entries[bounds[r] : bounds[r + 1]] for r in range(len(bounds) - 1)]


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
