"""Cross-field invariants of decoded messages: CSR shapes, value ranges, limits.

Vectorised with numpy so a 16k-token prefill or a 256-request decode checks in microseconds.
Every failure is a `SchemaError` subclass naming the field. On the hot path a boolean test is
`np.count_nonzero`, which costs a third of `ndarray.any()`/`.all()` on short arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from bridge_schema.batch import DRY_COLUMNS, FILTER_COLUMNS, PENALTY_COLUMNS, logit_mask_words
from bridge_schema.errors import FieldError, RangeError, ShapeError
from bridge_schema.limits import Limits
from bridge_schema.messages import (
    MAX_DECODE_STEPS,
    Adapter,
    Copy,
    Forward,
    ForwardResult,
    Message,
    Probe,
    SamplerKind,
)

_PROBE_ALL = int(Probe.LOGPROBS | Probe.DISTRIBUTION)
_MAX_SAMPLER = int(max(SamplerKind))  # enum lookups cost microseconds each on the hot path
_GREEDY = int(SamplerKind.GREEDY)
# Per-row bounds of the sampler floats (temperature, top_p, min_p), inclusive, in float32:
# temperature in [0, max finite], top_p in (0, 1], min_p in [0, 1).
_F32 = np.float32
_FLOAT_LO = np.array([[0.0], [np.nextafter(_F32(0), _F32(1))], [0.0]], dtype=_F32)
_FLOAT_HI = np.array([[np.finfo(_F32).max], [1.0], [np.nextafter(_F32(1), _F32(0))]], dtype=_F32)
_PER_OUTPUT = (
    "sampler",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "probe",
    "probe_k",
    "logit_mask_index",
)


def _counts(
    name: str, indptr: npt.NDArray[np.uint32], segments: int, data_len: int, min_count: int = 0
) -> npt.NDArray[np.int64]:
    """Validate a CSR indptr and return the per-segment counts (each at least `min_count`)."""
    if len(indptr) != segments + 1:
        raise ShapeError(f"has {len(indptr)} entries, expected {segments + 1}", name)
    if indptr[0] != 0:
        raise ShapeError(f"must start at 0, starts at {int(indptr[0])}", name)
    wide = indptr.astype(np.int64)
    counts: npt.NDArray[np.int64] = wide[1:] - wide[:-1]
    if segments and counts.min() < min_count:
        if counts.min() < 0:
            raise ShapeError("is not monotone", name)
        raise ShapeError(f"segment {int(np.argmin(counts))} is empty", name)
    if int(indptr[-1]) != data_len:
        raise ShapeError(f"ends at {int(indptr[-1])} but its data has {data_len} entries", name)
    return counts


_REQUEST_INDPTRS = ("token_indptr", "page_indptr", "mask_req_indptr", "out_indptr")


def _request_counts(f: Forward, r: int) -> npt.NDArray[np.int64]:
    """Counts per request of tokens, pages, mask rows and outputs ([4, R]), validating the four
    request-indexed indptrs in one go; on any failure the per-array check names what is wrong."""
    arrays = [getattr(f, name) for name in _REQUEST_INDPTRS]
    data_lens = [len(f.tokens), len(f.pages), len(f.mask_row_indptr) - 1, len(f.out_rows)]
    min_counts = (1, 1, 0, 0)
    if all(len(a) == r + 1 for a in arrays):
        wide = np.array(arrays, dtype=np.int64)
        counts: npt.NDArray[np.int64] = wide[:, 1:] - wide[:, :-1]
        if wide[:, 0].tolist() == [0, 0, 0, 0] and wide[:, -1].tolist() == data_lens:
            mins = counts.min(axis=1).tolist()
            if mins[0] >= 1 and mins[1] >= 1 and mins[2] >= 0 and mins[3] >= 0:  # `min_counts`
                return counts
    for name, array, n, lo in zip(_REQUEST_INDPTRS, arrays, data_lens, min_counts, strict=True):
        _counts(name, array, r, n, lo)
    raise AssertionError("request indptrs failed together but not one by one")


def check_forward(f: Forward, limits: Limits | None) -> None:
    r = len(f.context_ids)
    if r == 0:
        raise ShapeError("a forward carries at least one request", "context_ids")
    if len(f.adapter_ids) != r:
        raise ShapeError(f"has {len(f.adapter_ids)} entries for {r} requests", "adapter_ids")
    if len(f.positions) != len(f.tokens):
        raise ShapeError(f"has {len(f.positions)} entries for {len(f.tokens)} tokens", "positions")
    if len(f.last_page_len) != r:
        raise ShapeError(f"has {len(f.last_page_len)} entries for {r} requests", "last_page_len")
    if len(f.mask_row_indptr) == 0:
        raise ShapeError("needs at least one entry (0 when there are no rows)", "mask_row_indptr")
    if f.adapter_ids.min() < -1:
        raise RangeError("adapter ids are >= 0, or -1 for the base model", "adapter_ids")
    if f.last_page_len.min() < 1:
        raise RangeError("a last page holds at least one slot", "last_page_len")
    n_tokens, n_pages, n_rows, n_out = _request_counts(f, r)
    if len(f.mask_row_indptr) > 1:  # there are mask rows
        if ((n_rows != 0) & (n_rows != n_tokens)).any():
            bad = int(np.argmax((n_rows != 0) & (n_rows != n_tokens)))
            raise ShapeError(
                f"request {bad} has {int(n_rows[bad])} mask rows for {int(n_tokens[bad])} tokens (0 = causal)",
                "mask_req_indptr",
            )
        _counts("mask_row_indptr", f.mask_row_indptr, len(f.mask_row_indptr) - 1, len(f.mask_runs))
    elif f.mask_row_indptr[0] != 0 or len(f.mask_runs):
        _counts("mask_row_indptr", f.mask_row_indptr, 0, len(f.mask_runs))
    # Rows a request may sample: its tokens, plus the inputs of a multi-step request's later steps.
    n_inputs = n_tokens if not len(f.steps) else _check_steps(f, n_tokens, n_rows, n_out)
    _check_outputs(f, n_inputs, n_out)
    if len(f.deferred):
        _check_deferred(f, n_tokens)
    if limits is not None:
        _check_limits(f, limits, n_inputs, n_pages, n_rows)


def _check_steps(
    f: Forward, n_tokens: npt.NDArray[np.int64], n_rows: npt.NDArray[np.int64], n_out: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Multi-step requests are plain decode steps; returns the rows each request spans."""
    if len(f.steps) != len(n_tokens):
        raise ShapeError(f"has {len(f.steps)} entries for {len(n_tokens)} requests", "steps")
    steps = f.steps.astype(np.int64)
    if steps.min() < 1 or steps.max() > MAX_DECODE_STEPS:
        raise RangeError(f"a request runs 1 to {MAX_DECODE_STEPS} steps", "steps")
    multi = steps > 1
    if (n_tokens[multi] != 1).any():
        raise ShapeError("a multi-step request has exactly one input token", "steps")
    if (n_rows[multi] != 0).any():
        raise ShapeError("a multi-step request has no attention mask rows", "mask_req_indptr")
    if (n_out[multi] != steps[multi]).any():
        raise ShapeError("a multi-step request has one output row per step", "out_indptr")
    # Outputs of multi-step requests: rows 0..N-1 (strictly increasing, checked with the rest),
    # no probes and no logit masks.
    of_multi = np.repeat(multi, n_out)
    if len(f.probe) != len(of_multi) or len(f.logit_mask_index) != len(of_multi):
        return n_tokens + steps - 1  # misshaped outputs: `_check_outputs` names the field
    if (f.probe[of_multi] != 0).any():
        raise ShapeError("multi-step outputs carry no probes", "probe")
    if (f.logit_mask_index[of_multi] != -1).any():
        raise ShapeError("multi-step outputs carry no logit mask", "logit_mask_index")
    return n_tokens + steps - 1


def _check_deferred(f: Forward, n_tokens: npt.NDArray[np.int64]) -> None:
    d = f.deferred
    if len(d) > 1 and np.count_nonzero(d[1:] <= d[:-1]):
        raise ShapeError("request indices must be strictly increasing", "deferred")
    if int(d[-1]) >= len(n_tokens):
        raise RangeError(f"request index {int(d[-1])} >= {len(n_tokens)} requests", "deferred")
    if np.count_nonzero(n_tokens[d] == 0):
        raise ShapeError("a deferred request has no token to replace", "deferred")
    if np.count_nonzero(f.tokens[f.token_indptr[d]]):
        raise RangeError("a deferred request's first token is sent as 0", "tokens")


def _check_outputs(f: Forward, n_inputs: npt.NDArray[np.int64], n_out: npt.NDArray[np.int64]) -> None:
    o = len(f.out_rows)
    for name in _PER_OUTPUT:
        if len(getattr(f, name)) != o:
            raise ShapeError(f"has {len(getattr(f, name))} entries for {o} output rows", name)
    if len(f.score_tokens) not in (0, o):
        raise ShapeError(f"has {len(f.score_tokens)} entries for {o} output rows (or none)", "score_tokens")
    if len(f.score_tokens) and int(f.score_tokens.min()) < -1:
        raise RangeError("must be a token id, or -1 for none", "score_tokens")
    if (
        len(f.repetition_penalty)
        or len(f.penalty_from)
        or len(f.logit_bias_indptr)
        or len(f.logit_bias)
        or len(f.typical_p)
        or len(f.xtc_threshold)
        or len(f.dry_multiplier)
        or len(f.dry_last_n)
        or len(f.dry_breaker_indptr)
        or len(f.dry_breaker_ids)
    ):
        _check_chain(f, o)
    if o == 0:
        return
    is_one_each = o == len(n_inputs) and int(n_out.max()) == 1  # the common decode batch
    request_of = None if is_one_each else np.repeat(np.arange(len(n_inputs)), n_out)
    if np.count_nonzero(f.out_rows >= (n_inputs if request_of is None else n_inputs[request_of])):
        raise RangeError("an output row is past its request's tokens", "out_rows")
    if request_of is not None and o > 1:
        same_request = request_of[1:] == request_of[:-1]
        if np.count_nonzero(same_request & (f.out_rows[1:] <= f.out_rows[:-1])):
            raise ShapeError("rows of one request must be strictly increasing", "out_rows")
    # One combined test on the fast path; the per-field tests below only run to name the field.
    # The sampler floats as the rows of one [3, O] array against per-row bounds (written so
    # that NaN fails); then temperature 0 only on greedy rows, and the integer fields' ranges.
    floats = np.concatenate((f.temperature, f.top_p, f.min_p)).reshape(3, o)
    if (
        np.count_nonzero((floats >= _FLOAT_LO) & (floats <= _FLOAT_HI)) == 3 * o
        and (
            np.count_nonzero(f.temperature) == o or not np.count_nonzero((f.temperature == 0) & (f.sampler != _GREEDY))
        )
        and int(f.sampler.max()) <= _MAX_SAMPLER
        and int(f.probe.max()) <= _PROBE_ALL
        and int(f.seed.min()) >= -1
        and int(f.logit_mask_index.min()) >= -1
    ):
        return
    temperature_ok = ((f.temperature > 0) & (f.temperature < np.inf)) | ((f.temperature == 0) & (f.sampler == _GREEDY))
    for field, valid, message in (
        ("sampler", f.sampler <= _MAX_SAMPLER, "unknown sampler kind"),
        ("temperature", temperature_ok, "must be finite and > 0 for random sampling (use greedy for 0)"),
        ("top_p", (f.top_p > 0) & (f.top_p <= 1), "must be in (0, 1]"),
        ("min_p", (f.min_p >= 0) & (f.min_p < 1), "must be in [0, 1)"),
        ("seed", f.seed >= -1, "must be >= 0, or -1 for unseeded"),
        ("probe", f.probe <= _PROBE_ALL, "unknown probe flag"),
        ("logit_mask_index", f.logit_mask_index >= -1, "must be >= 0, or -1 for unconstrained"),
    ):
        if not valid.all():
            raise RangeError(message, field)
    raise AssertionError("an output check failed without naming its field")


_PENALTY_FIELDS = tuple(name for name, _ in PENALTY_COLUMNS)


def _check_chain(f: Forward, o: int) -> None:
    """The sampler chain's columns: the penalties all present ([O]) or all empty, finite (the
    decoder has rejected NaN and infinity), repetition > 0; the bias a CSR over the outputs
    whose ids rise strictly within a row (token ranges are checked against the vocabulary with
    the limits)."""
    lengths = {len(getattr(f, name)) for name in _PENALTY_FIELDS}
    if lengths != {0}:
        for name in _PENALTY_FIELDS:
            if len(getattr(f, name)) != o:
                raise ShapeError(f"has {len(getattr(f, name))} entries for {o} output rows (or none)", name)
        if np.count_nonzero(f.repetition_penalty > 0) != o:
            raise RangeError("must be > 0 (1 = off)", "repetition_penalty")
    if {len(getattr(f, name)) for name in FILTER_COLUMNS} != {0}:
        for name in FILTER_COLUMNS:
            if len(getattr(f, name)) != o:
                raise ShapeError(f"has {len(getattr(f, name))} entries for {o} output rows (or none)", name)
        for name, valid, message in (
            ("typical_p", (f.typical_p > 0) & (f.typical_p <= 1), "must be in (0, 1]"),
            ("top_n_sigma", f.top_n_sigma >= 0, "must be >= 0 (0 = off)"),
            ("xtc_probability", (f.xtc_probability >= 0) & (f.xtc_probability <= 1), "must be in [0, 1]"),
            ("xtc_threshold", (f.xtc_threshold >= 0) & (f.xtc_threshold <= 1), "must be in [0, 1]"),
            ("mirostat_tau", f.mirostat_tau >= 0, "must be >= 0 (0 = off)"),
            ("mirostat_eta", (f.mirostat_eta >= 0) & (f.mirostat_eta <= 1), "must be in [0, 1]"),
        ):
            if np.count_nonzero(valid) != o:
                raise RangeError(message, name)
    _check_dry(f, o)
    if len(f.logit_bias_indptr) or len(f.logit_bias_ids) or len(f.logit_bias):
        counts = _counts("logit_bias_indptr", f.logit_bias_indptr, o, len(f.logit_bias_ids))
        if len(f.logit_bias) != len(f.logit_bias_ids):
            raise ShapeError(f"has {len(f.logit_bias)} entries for {len(f.logit_bias_ids)} ids", "logit_bias")
        ids = f.logit_bias_ids.astype(np.int64)
        if len(ids) > 1:
            new_row = np.zeros(len(ids), dtype=bool)
            new_row[f.logit_bias_indptr[:-1][counts > 0].astype(np.int64)] = True
            if np.count_nonzero((ids[1:] <= ids[:-1]) & ~new_row[1:]):
                raise ShapeError("ids must be strictly increasing within a row", "logit_bias_ids")


def _check_dry(f: Forward, o: int) -> None:
    """DRY's columns all [O] with its breakers' CSR, or all empty; multiplier >= 0, base >= 1."""
    lengths = {len(getattr(f, name)) for name, _ in DRY_COLUMNS} | {len(f.dry_breaker_indptr), len(f.dry_breaker_ids)}
    if lengths == {0}:
        return
    for name, _ in DRY_COLUMNS:
        if len(getattr(f, name)) != o:
            raise ShapeError(f"has {len(getattr(f, name))} entries for {o} output rows (or none)", name)
    _counts("dry_breaker_indptr", f.dry_breaker_indptr, o, len(f.dry_breaker_ids))
    if np.count_nonzero(f.dry_multiplier >= 0) != o:
        raise RangeError("must be >= 0 (0 = off)", "dry_multiplier")
    if np.count_nonzero(f.dry_base >= 1) != o:
        raise RangeError("must be >= 1", "dry_base")


def _check_limits(
    f: Forward,
    lim: Limits,
    n_inputs: npt.NDArray[np.int64],
    n_pages: npt.NDArray[np.int64],
    n_rows: npt.NDArray[np.int64],
) -> None:
    if len(f.context_ids) > lim.max_requests_per_pass:
        raise RangeError(f"{len(f.context_ids)} requests exceed the limit {lim.max_requests_per_pass}", "context_ids")
    if len(f.tokens) > lim.max_tokens_per_pass:
        raise RangeError(f"{len(f.tokens)} tokens exceed the limit {lim.max_tokens_per_pass}", "tokens")
    if len(f.tokens) and int(f.tokens.max()) >= lim.vocab_size:
        raise RangeError(f"token id {int(f.tokens.max())} >= vocab size {lim.vocab_size}", "tokens")
    if len(f.score_tokens) and int(f.score_tokens.max()) >= lim.vocab_size:
        raise RangeError(f"token id {int(f.score_tokens.max())} >= vocab size {lim.vocab_size}", "score_tokens")
    if len(f.positions) and int(f.positions.max()) >= lim.max_context:
        raise RangeError(f"position {int(f.positions.max())} >= max context {lim.max_context}", "positions")
    if int(f.pages.max()) >= lim.num_pages:
        raise RangeError(f"page {int(f.pages.max())} >= number of pages {lim.num_pages}", "pages")
    if int(f.last_page_len.max()) > lim.page_size:
        raise RangeError(f"{int(f.last_page_len.max())} > page size {lim.page_size}", "last_page_len")
    kv_len = (n_pages - 1) * lim.page_size + f.last_page_len.astype(np.int64)
    if np.count_nonzero(kv_len < n_inputs):
        bad = int(np.argmax(kv_len < n_inputs))
        raise ShapeError(f"request {bad} has {int(kv_len[bad])} KV slots for {int(n_inputs[bad])} tokens", "pages")
    mask_bytes = 4 * (len(f.mask_runs) + len(f.logit_masks))
    if mask_bytes > lim.max_mask_bytes:
        raise RangeError(f"{mask_bytes} mask bytes exceed the limit {lim.max_mask_bytes}", "mask_runs")
    if len(f.mask_runs):
        cum = np.concatenate(([0], np.cumsum(f.mask_runs, dtype=np.int64)))
        row_sums = cum[f.mask_row_indptr[1:]] - cum[f.mask_row_indptr[:-1]]
        row_kv = np.repeat(kv_len, n_rows)
        if (row_sums != row_kv).any():
            bad = int(np.argmax(row_sums != row_kv))
            raise ShapeError(
                f"row {bad} covers {int(row_sums[bad])} keys, its request has {int(row_kv[bad])}", "mask_runs"
            )
    elif len(f.mask_row_indptr) > 1:
        raise ShapeError("mask rows have no runs; a row covers all of its request's keys", "mask_runs")
    words = logit_mask_words(lim.vocab_size)
    if len(f.logit_masks) % words:
        raise ShapeError(f"{len(f.logit_masks)} words is not a whole number of {words}-word masks", "logit_masks")
    if len(f.logit_mask_index) and int(f.logit_mask_index.max()) >= len(f.logit_masks) // words:
        raise RangeError("points past the last logit mask", "logit_mask_index")
    if len(f.logit_bias_ids) and int(f.logit_bias_ids.max()) >= lim.vocab_size:
        raise RangeError(f"token id {int(f.logit_bias_ids.max())} >= vocab size {lim.vocab_size}", "logit_bias_ids")
    if len(f.dry_breaker_ids) and int(f.dry_breaker_ids.max()) >= lim.vocab_size:
        raise RangeError(f"token id {int(f.dry_breaker_ids.max())} >= vocab size {lim.vocab_size}", "dry_breaker_ids")
    if len(f.probe_k) and int(f.probe_k.max()) > lim.max_probe_k:
        raise RangeError(f"{int(f.probe_k.max())} exceeds the limit {lim.max_probe_k}", "probe_k")


def check_forward_result(res: ForwardResult, limits: Limits | None) -> None:
    o = len(res.tokens)
    if len(res.logprobs) != o:
        raise ShapeError(f"has {len(res.logprobs)} entries for {o} outputs", "logprobs")
    for name, indptr, data_len in (
        ("topk_indptr", res.topk_indptr, len(res.topk_ids)),
        ("dist_indptr", res.dist_indptr, len(res.dists)),
    ):
        # Most replies carry no probes: an all-zero indptr over no data is valid as it stands.
        if data_len or len(indptr) != o + 1 or np.count_nonzero(indptr):
            _counts(name, indptr, o, data_len)
    if len(res.topk_logprobs) != len(res.topk_ids):
        raise ShapeError("must match topk_ids", "topk_logprobs")
    if limits is not None and o and int(res.tokens.max()) >= limits.vocab_size:
        raise RangeError("sampled token outside the vocabulary", "tokens")


def check_copy(c: Copy, limits: Limits | None) -> None:
    if len(c.src_pages) != len(c.dst_pages):
        raise ShapeError(f"has {len(c.dst_pages)} entries for {len(c.src_pages)} sources", "dst_pages")
    if len(np.unique(c.dst_pages)) != len(c.dst_pages):
        raise ShapeError("destinations must be distinct", "dst_pages")
    if np.isin(c.dst_pages, c.src_pages).any():
        raise ShapeError("a destination is also a source", "dst_pages")
    if limits is not None and len(c.src_pages):
        for name in ("src_pages", "dst_pages"):
            top = int(getattr(c, name).max())
            if top >= limits.num_pages:
                raise RangeError(f"page {top} >= number of pages {limits.num_pages}", name)


def check_adapter(a: Adapter, limits: Limits | None) -> None:
    if a.op not in ("load", "unload"):
        raise FieldError(f"must be 'load' or 'unload', got {a.op!r}", "op")
    if a.op == "load" and not a.path:
        raise FieldError("load needs a path", "path")


CHECKS: dict[type[Message], Callable[..., None]] = {
    Forward: check_forward,
    ForwardResult: check_forward_result,
    Copy: check_copy,
    Adapter: check_adapter,
}
