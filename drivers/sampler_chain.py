"""The sampler chain's stages before the sampler (`Forward`'s "Sampler chain"), shared by every
driver: the token in every KV slot (`SlotTokens`, what the penalties count), the stages' work as
flat per-entry arrays, and plain numpy versions of every stage and of the sampler (the dummy
driver's path, and the reference the torch driver is tested against).

A driver keeps a `SlotTokens` beside its KV cache: `write` each pass before it runs, `copy`
with the pages. The penalties then need no state per context: a fork shares or copies its
parent's pages, a truncation or rollback shortens kv_len, and a new host re-fills its pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bridge_schema.batch import DRY_COLUMNS, FILTER_COLUMNS, PENALTY_COLUMNS
from bridge_schema.messages import Forward

# Random sampling considers the PREFILTER most likely tokens; the rest carry ~0 mass.
PREFILTER = 256
I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]


def _kv_lens(f: Forward, page_size: int) -> I64:
    n_pages = np.diff(f.page_indptr.astype(np.int64))
    return (n_pages - 1) * page_size + f.last_page_len.astype(np.int64)


def _flat_slots(f: Forward, request: int, slots: I64, page_size: int) -> I64:
    """Indices into a `SlotTokens` table of `request`'s KV `slots`."""
    first_page = int(f.page_indptr[request])
    return f.pages[first_page + slots // page_size].astype(np.int64) * page_size + slots % page_size


class SlotTokens:
    """The token written into each KV slot, -1 where none has been; and Mirostat's mu after the
    step whose input is the slot's token, NaN where none has run since the token was written."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.table = np.full(num_pages * page_size, -1, dtype=np.int32)
        self.mu = np.full(num_pages * page_size, np.nan, dtype=np.float32)

    def write(self, f: Forward) -> None:
        """Record `f`'s input tokens at their slots: request r's fill the last of its kv_len
        (a single-step `Forward`: `drivers.multistep` splits the others before a driver runs)."""
        ps = self.page_size
        token_ptr = f.token_indptr.astype(np.int64)
        n_tokens = np.diff(token_ptr)
        request = np.repeat(np.arange(len(n_tokens)), n_tokens)
        slot = (_kv_lens(f, ps) - n_tokens)[request] + np.arange(len(f.tokens)) - token_ptr[request]
        page = f.pages[f.page_indptr[request].astype(np.int64) + slot // ps].astype(np.int64)
        flat = page * ps + slot % ps
        self.table[flat] = f.tokens
        self.mu[flat] = np.nan

    def copy(self, src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike) -> None:
        src, dst = np.asarray(src_pages, dtype=np.int64), np.asarray(dst_pages, dtype=np.int64)
        for table in (self.table, self.mu):
            view = table.reshape(-1, self.page_size)
            view[dst] = view[src]

    def _row_slots(self, f: Forward, rows: I64, back: int) -> tuple[I64, npt.NDArray[np.bool_]]:
        """Table indices of the slots `back` before `rows`' own (through the page table), and
        which of them exist (slot >= 0)."""
        ps = self.page_size
        out_ptr = f.out_indptr.astype(np.int64)
        request = np.repeat(np.arange(len(out_ptr) - 1), np.diff(out_ptr))[rows]
        first_slot = _kv_lens(f, ps) - np.diff(f.token_indptr.astype(np.int64))
        slot = first_slot[request] + f.out_rows[rows].astype(np.int64) - back
        exists = slot >= 0
        slot = np.maximum(slot, 0)
        page = f.pages[f.page_indptr[request].astype(np.int64) + slot // ps].astype(np.int64)
        return page * ps + slot % ps, exists

    def mirostat_mu(self, f: Forward, rows: I64) -> F32:
        """The mu each of `rows` starts from: the one its previous slot's step left, else 2 * tau."""
        previous, exists = self._row_slots(f, rows, 1)
        mu = np.where(exists, self.mu[previous], np.nan).astype(np.float32)
        fresh = np.isnan(mu)
        mu[fresh] = 2 * f.mirostat_tau[rows][fresh]
        return mu  # type: ignore[no-any-return]

    def set_mirostat_mu(self, f: Forward, rows: I64, mu: npt.ArrayLike) -> None:
        """Record the mu `rows`' steps leave, at their own slots."""
        own, _ = self._row_slots(f, rows, 0)
        self.mu[own] = mu


@dataclass(slots=True)
class Entries:
    """Per (output row, token) pair a stage touches: the row, the token, and what to do to it.
    Pairs are distinct, so a scatter writes each logit once."""

    rows: I64
    ids: I64
    # Logit bias: the value to add. Penalties: the counts in the presence/frequency window, whether
    # the token is in the repetition window, and the row's three penalties.
    bias: F32 | None = None
    counts: F32 | None = None
    repeated: npt.NDArray[np.bool_] | None = None
    repetition: F32 | None = None
    presence: F32 | None = None
    frequency: F32 | None = None


def bias_entries(f: Forward) -> Entries | None:
    if not len(f.logit_bias_ids):
        return None
    counts = np.diff(f.logit_bias_indptr.astype(np.int64))
    rows = np.repeat(np.arange(len(counts)), counts)
    return Entries(rows, f.logit_bias_ids.astype(np.int64), bias=f.logit_bias)


def _own_slots(f: Forward, page_size: int) -> Callable[[int], tuple[int, int]]:
    """Output row o -> (its request, the KV slot of its own input token)."""
    out_ptr = f.out_indptr.astype(np.int64)
    request_of = np.repeat(np.arange(len(out_ptr) - 1), np.diff(out_ptr))
    first_slot = _kv_lens(f, page_size) - np.diff(f.token_indptr.astype(np.int64))

    def own(o: int) -> tuple[int, int]:
        r = int(request_of[o])
        return r, int(first_slot[r]) + int(f.out_rows[o])

    return own


def penalty_entries(f: Forward, tokens: SlotTokens) -> Entries | None:
    """The penalties' pairs: per output row with a penalty, every token in its windows."""
    if not len(f.repetition_penalty):
        return None
    active = np.flatnonzero(
        (f.repetition_penalty != 1) | (f.presence_penalty != 0) | (f.frequency_penalty != 0)
    ).tolist()
    if not active:
        return None
    ps = tokens.page_size
    own_slot = _own_slots(f, ps)
    parts: list[tuple[int, I64, F32, npt.NDArray[np.bool_]]] = []
    for o in active:
        r, s = own_slot(o)
        last_n = int(f.penalty_last_n[o])
        recent = s + 1 - last_n if last_n else 0
        lo_pf, lo_rep = max(int(f.penalty_from[o]), recent), max(int(f.repetition_from[o]), recent)
        lo = min(lo_pf, lo_rep)
        if lo > s:
            continue
        slots = np.arange(lo, s + 1, dtype=np.int64)
        seen = tokens.table[_flat_slots(f, r, slots, ps)]
        written = seen >= 0
        ids, inverse = np.unique(seen[written], return_inverse=True)
        slots = slots[written]
        counts = np.bincount(inverse, weights=slots >= lo_pf, minlength=len(ids)).astype(np.float32)
        repeated = np.bincount(inverse, weights=slots >= lo_rep, minlength=len(ids)) > 0
        parts.append((o, ids.astype(np.int64), counts, repeated))
    if not parts:
        return None
    sizes = [len(p[1]) for p in parts]
    rows = np.repeat(np.array([p[0] for p in parts], dtype=np.int64), sizes)
    return Entries(
        rows,
        np.concatenate([p[1] for p in parts]),
        counts=np.concatenate([p[2] for p in parts]),
        repeated=np.concatenate([p[3] for p in parts]),
        repetition=f.repetition_penalty[rows],
        presence=f.presence_penalty[rows],
        frequency=f.frequency_penalty[rows],
    )


# llama.cpp caps DRY's exponent where dry_base ** exponent would pass float32's range.
_DRY_MAX_LOG = 88.7228391


def dry_entries(f: Forward, tokens: SlotTokens) -> Entries | None:
    """DRY's pairs (`Forward`'s "Sampler chain"): per output row with DRY, every token that
    would continue a repeat of at least its allowed length, and the (negative) value to add."""
    if not len(f.dry_multiplier):
        return None
    active = np.flatnonzero(f.dry_multiplier > 0).tolist()
    if not active:
        return None
    ps = tokens.page_size
    own_slot = _own_slots(f, ps)
    breaker_ptr = f.dry_breaker_indptr.astype(np.int64)
    parts: list[tuple[int, I64, F32]] = []
    for o in active:
        r, s = own_slot(o)
        last_n = int(f.dry_last_n[o])
        slots = np.arange(max(0, s + 1 - last_n) if last_n else 0, s + 1, dtype=np.int64)
        window = tokens.table[_flat_slots(f, r, slots, ps)].astype(np.int64)
        breakers = f.dry_breaker_ids[breaker_ptr[o] : breaker_ptr[o + 1]].astype(np.int64)
        lengths = _dry_repeats(window, breakers)
        allowed = int(f.dry_allowed_length[o])
        hits = np.flatnonzero(lengths >= max(allowed, 1))
        hits = hits[window[hits + 1] >= 0]  # an unwritten slot is no token to penalize
        if not len(hits):
            continue
        following = window[hits + 1]
        ids, inverse = np.unique(following, return_inverse=True)
        longest = np.zeros(len(ids), dtype=np.int64)
        np.maximum.at(longest, inverse, lengths[hits])
        base = float(f.dry_base[o])
        exponent = (longest - allowed).astype(np.float64)
        if base > 1.000001:
            exponent = np.minimum(exponent, np.floor(_DRY_MAX_LOG / np.log(base)))
        penalty = float(f.dry_multiplier[o]) * np.power(np.float64(base), exponent)
        parts.append((o, ids, (-penalty).astype(np.float32)))
    if not parts:
        return None
    rows = np.repeat(np.array([p[0] for p in parts], dtype=np.int64), [len(p[1]) for p in parts])
    return Entries(rows, np.concatenate([p[1] for p in parts]), bias=np.concatenate([p[2] for p in parts]))


def _dry_repeats(window: I64, breakers: I64) -> I64:
    """For each position e of `window` but its last: the length of the longest run ending at e
    equal to the run ending at the last token, at most the tokens after the last breaker (an
    unwritten slot, -1, is one)."""
    n = len(window)
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    is_breaker = (window < 0) | np.isin(window, breakers)
    after = np.flatnonzero(is_breaker)
    limit = n - 1 - int(after[-1]) if len(after) else n
    lengths = np.zeros(n - 1, dtype=np.int64)
    ends = np.arange(n - 1)
    live = window[:-1] == window[-1]
    for q in range(limit):
        if q:
            live &= ends - q >= 0
            live[live] = window[ends[live] - q] == window[n - 1 - q]
        if not live.any():
            break
        lengths[live] += 1
    return lengths


def penalized(values: F32, e: Entries) -> F32:
    """`values` (the entries' logits) after the penalties."""
    assert e.counts is not None and e.repeated is not None and e.repetition is not None
    assert e.presence is not None and e.frequency is not None
    by_repetition = np.where(values > 0, values / e.repetition, values * e.repetition)
    values = np.where(e.repeated, by_repetition, values)
    return values - e.presence * (e.counts > 0) - e.frequency * e.counts  # type: ignore[no-any-return]


def take_outputs(f: Forward, outputs: I64) -> dict[str, npt.NDArray[np.generic]]:
    """The chain's columns for a `Forward` of `f`'s output rows `outputs`, in that order (the
    columns of a group `f` leaves empty stay empty)."""
    columns: dict[str, npt.NDArray[np.generic]] = {}
    if len(f.repetition_penalty):
        for name in PENALTY_FIELDS:
            columns[name] = getattr(f, name)[outputs]
    if len(f.typical_p):
        for name in FILTER_COLUMNS:
            columns[name] = getattr(f, name)[outputs]
    if len(f.logit_bias_indptr):
        indptr, index = _take_csr(f.logit_bias_indptr, outputs)
        columns["logit_bias_indptr"] = indptr
        columns["logit_bias_ids"] = f.logit_bias_ids[index]
        columns["logit_bias"] = f.logit_bias[index]
    if len(f.dry_multiplier):
        for name, _ in DRY_COLUMNS:
            columns[name] = getattr(f, name)[outputs]
        indptr, index = _take_csr(f.dry_breaker_indptr, outputs)
        columns["dry_breaker_indptr"] = indptr
        columns["dry_breaker_ids"] = f.dry_breaker_ids[index]
    return columns


def _take_csr(indptr: npt.NDArray[np.uint32], outputs: I64) -> tuple[npt.NDArray[np.uint32], I64]:
    """The indptr of a CSR over `outputs` (in that order), and the indices of their entries."""
    ptr = indptr.astype(np.int64)
    picks = [np.arange(ptr[o], ptr[o + 1]) for o in outputs.tolist()]
    index = np.concatenate(picks) if picks else np.zeros(0, np.int64)
    return np.concatenate(([0], np.cumsum(ptr[outputs + 1] - ptr[outputs]))).astype(np.uint32), index


PENALTY_FIELDS = tuple(name for name, _ in PENALTY_COLUMNS)


def apply_chain_np(logits: F32, f: Forward, tokens: SlotTokens) -> F32:
    """The plain version: `logits` [O, V] after the logit bias and the penalties (a copy)."""
    out = np.array(logits, dtype=np.float32)
    bias = bias_entries(f)
    if bias is not None:
        assert bias.bias is not None
        out[bias.rows, bias.ids] += bias.bias
    penalties = penalty_entries(f, tokens)
    if penalties is not None:
        out[penalties.rows, penalties.ids] = penalized(out[penalties.rows, penalties.ids], penalties)
    dry = dry_entries(f, tokens)
    if dry is not None:
        assert dry.bias is not None
        out[dry.rows, dry.ids] += dry.bias
    return out


@dataclass(frozen=True, slots=True)
class Filters:
    """A random row's filters besides top-k, top-p and min-p (off by default), and XTC's draw."""

    typical_p: float = 1.0
    top_n_sigma: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_draw: float = 1.0
    mirostat_tau: float = 0.0
    mirostat_eta: float = 0.1
    mirostat_mu: float = 0.0  # the row's mu going in

    @staticmethod
    def of(f: Forward, o: int, xtc_draw: float, mu: float = 0.0) -> Filters:
        if not len(f.typical_p):
            return Filters()
        typical, sigma = float(f.typical_p[o]), float(f.top_n_sigma[o])
        xtc, threshold = float(f.xtc_probability[o]), float(f.xtc_threshold[o])
        return Filters(typical, sigma, xtc, threshold, xtc_draw, float(f.mirostat_tau[o]), float(f.mirostat_eta[o]), mu)


def sample_row_np(
    logits: F32, temperature: float, top_k: int, top_p: float, min_p: float, u: float, filters: Filters = Filters()
) -> int:
    """The plain random sampler on one row (`sample_row_with_state`'s token)."""
    return sample_row_with_state(logits, temperature, top_k, top_p, min_p, u, filters)[0]


def sample_row_with_state(
    logits: F32, temperature: float, top_k: int, top_p: float, min_p: float, u: float, filters: Filters = Filters()
) -> tuple[int, float]:
    """The plain random sampler on one row: temperature over the PREFILTER most likely tokens,
    then top-n-sigma, top-k, top-p (the mass of the strictly more likely tokens below top_p; the
    first always kept) and min-p (against the most likely), typical, XTC and Mirostat 2
    (`Forward`'s "Sampler chain"), then the token where the kept mass's CDF passes u * total.
    Returns it with Mirostat's mu after the draw (NaN without Mirostat)."""
    finite_logits = logits[np.isfinite(logits)].astype(np.float64) / temperature
    order = np.argsort(-logits, kind="stable")[:PREFILTER]
    scaled = logits[order].astype(np.float64) / temperature
    finite = np.isfinite(scaled)
    probs = np.zeros_like(scaled)
    probs[finite] = np.exp(scaled[finite] - scaled[0])
    probs /= probs.sum()
    rank = np.arange(len(probs))
    keep = (rank < top_k) if top_k else np.ones(len(probs), dtype=bool)
    if filters.top_n_sigma > 0:
        keep &= scaled >= scaled[0] - filters.top_n_sigma * finite_logits.std()
    keep &= (np.cumsum(probs) - probs < top_p) | (rank == 0)
    keep &= probs >= min_p * probs[0]
    if filters.typical_p < 1:
        keep &= _typical(np.where(keep, probs, 0.0), filters.typical_p)
    if filters.xtc_probability > 0 and filters.xtc_draw < filters.xtc_probability:
        q = np.where(keep, probs, 0.0)
        above = np.flatnonzero(q / q.sum() >= filters.xtc_threshold)
        if len(above) >= 2:
            keep[above[:-1]] = False  # all but the least likely of them
    mu = float("nan")
    if filters.mirostat_tau > 0:
        q = np.where(keep, probs, 0.0)
        surprise = np.full(len(q), np.inf)
        surprise[q > 0] = -np.log2(q[q > 0] / q.sum())
        within = surprise <= filters.mirostat_mu
        keep &= within if within.any() else rank == int(np.argmax(keep))  # at least the best kept
    cdf = np.cumsum(np.where(keep, probs, 0.0))
    pick = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(order) - 1)
    if filters.mirostat_tau > 0:
        observed = -np.log2(probs[pick] / cdf[-1])
        mu = filters.mirostat_mu - filters.mirostat_eta * (observed - filters.mirostat_tau)
    return int(order[pick]), mu


def _typical(kept: npt.NDArray[np.float64], mass: float) -> npt.NDArray[np.bool_]:
    """Locally typical sampling over the kept probabilities (0 where not kept): the tokens whose
    surprisal is nearest the entropy, fewest first, until they hold `mass`."""
    q = kept / kept.sum()
    live = q > 0
    surprisal = np.full(len(q), np.inf)
    surprisal[live] = -np.log(q[live])
    entropy = float(np.sum(q[live] * surprisal[live]))
    order = np.argsort(np.abs(surprisal - entropy), kind="stable")
    before = np.cumsum(q[order]) - q[order]
    chosen = np.zeros(len(q), dtype=bool)
    chosen[order[(before < mass) & live[order]]] = True
    return chosen
