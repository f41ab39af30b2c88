"""Turns a validated `Forward` into the tensors one pass needs: flat tokens, the cache slot of
each new token, padded per-request query layouts, and per attention family (full or a window) the
keys its cache returns with a mask built for exactly those keys. Knows the CSR wire layout and the
page arithmetic; knows nothing of the model math."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from bridge_schema.messages import Forward
from drivers.errors import RequestRejected
from drivers.torch.kernels import cpu_kernels
from drivers.torch.masks import check_mask_rows, decode_brle_rows
from drivers.torch.sampling import SamplingPlan, plan_sampling


@dataclass(frozen=True, slots=True)
class CacheLimits:
    page_size: int
    num_pages: int
    vocab_size: int
    max_context: int
    max_probe_k: int


@dataclass(slots=True)
class FamilyKeys:
    """The keys one attention family reads for each request, padded to `key_slot.shape[1]`."""

    window: int
    key_index: torch.Tensor  # [B, K] flat cache index of each key (0 for padding)
    key_slot: torch.Tensor  # [B, K] slot of each key within its request (-1 for padding)
    mask: torch.Tensor  # [B, Tq, K] causal & window & sinks & user mask, for exactly these keys
    empty: torch.Tensor  # [B, Tq] rows that may attend to nothing (padding, or a user mask)
    safe_mask: torch.Tensor  # `mask` with empty rows opened to every key (their output is zeroed)


@dataclass(slots=True)
class PassPlan:
    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat cache index each new token's k/v is written to
    q_slot: torch.Tensor  # [T] slot of each new token within its request
    token_request: torch.Tensor  # [T] owning request
    q_index: torch.Tensor  # [B, Tq] flat token of each padded query (0 for padding)
    q_valid: torch.Tensor  # [B, Tq]
    kv_len: torch.Tensor  # [B]
    num_q: torch.Tensor  # [B]
    q_start: torch.Tensor  # [B] first flat token of each request
    page_table: torch.Tensor  # [B, max_pages] int32 page ids (0 for padding)
    user_mask: torch.Tensor | None  # [T, max_kv] bool, all True on rows without a mask
    out_tokens: torch.Tensor  # [O] flat token of each output row
    # The same on the host, as numpy (`family_keys` is built from them):
    kv_len_np: npt.NDArray[np.int64]
    num_q_np: npt.NDArray[np.int64]
    page_table_np: npt.NDArray[np.int32]
    q_slot_np: npt.NDArray[np.int64]
    q_index_np: npt.NDArray[np.int64]
    q_valid_np: npt.NDArray[np.bool_]
    out_tokens_np: npt.NDArray[np.int64]
    # What sampling does for the pass's outputs, made (and checked) with the rest of the plan,
    # before the model runs; None only in the CUDA graphs' buckets, which are never sampled.
    sampling: SamplingPlan | None = None
    families: dict[int, FamilyKeys] = field(default_factory=dict)
    query_blocks: dict[int, torch.Tensor] = field(default_factory=dict)  # kernel tiling, by block size


def _counts(indptr: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
    return np.diff(indptr.astype(np.int64))


def _check(
    fwd: Forward, limits: CacheLimits
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Validate against the model and the cache (the mask rows apart: `check_mask_rows`); returns
    (num_tokens, num_pages, kv_len) per request."""
    ps = limits.page_size
    num_tokens = _counts(fwd.token_indptr)
    num_pages = _counts(fwd.page_indptr)
    last = fwd.last_page_len.astype(np.int64)
    if fwd.tokens.size and int(fwd.tokens.max()) >= limits.vocab_size:
        raise RequestRejected(f"token id >= vocab size {limits.vocab_size}", "tokens")
    if fwd.positions.size and int(fwd.positions.max()) >= limits.max_context:
        raise RequestRejected(f"position >= max_context {limits.max_context}", "positions")
    if fwd.pages.size and int(fwd.pages.max()) >= limits.num_pages:
        raise RequestRejected(f"page id >= num_pages {limits.num_pages}", "pages")
    if np.any((num_tokens > 0) & (num_pages == 0)):
        raise RequestRejected("a request with tokens has no pages", "page_indptr")
    if np.any((num_pages > 0) & ((last < 1) | (last > ps))):
        raise RequestRejected(f"last_page_len must be in 1..{ps}", "last_page_len")
    kv_len = np.where(num_pages > 0, (num_pages - 1) * ps + last, 0)
    if np.any(kv_len < num_tokens):
        raise RequestRejected("a request has more new tokens than kv slots", "last_page_len")
    if np.any(kv_len > limits.max_context):
        raise RequestRejected(f"kv_len exceeds max_context {limits.max_context}", "page_indptr")
    out_counts = _counts(fwd.out_indptr)
    owner = np.repeat(np.arange(len(num_tokens)), out_counts)
    if fwd.out_rows.size and np.any(fwd.out_rows.astype(np.int64) >= num_tokens[owner]):
        raise RequestRejected("an output row is past its request's tokens", "out_rows")
    if fwd.probe_k.size and int(fwd.probe_k.max()) > limits.max_probe_k:
        raise RequestRejected(f"probe_k exceeds {limits.max_probe_k}", "probe_k")
    return num_tokens, num_pages, kv_len


_PlanArrays = tuple[npt.NDArray[np.generic], ...]


def _plan_arrays(fwd: Forward, limits: CacheLimits) -> _PlanArrays:
    """`_check`, then the pass's arrays: (num_tokens, kv_len, token_request, q_slot, slots,
    q_valid, q_index, page_table, out_tokens, q_start, tokens, positions). In C++ (`pass_plan.cpp`,
    one call) once the kernels are loaded, else in numpy (`_plan_arrays_numpy`): the same arrays."""
    native = cpu_kernels.pass_planner()
    if native is not None:
        out = native.plan_arrays(
            fwd.token_indptr,
            fwd.tokens,
            fwd.positions,
            fwd.page_indptr,
            fwd.pages,
            fwd.last_page_len,
            fwd.out_indptr,
            fwd.out_rows,
            fwd.probe_k,
            limits.page_size,
            limits.num_pages,
            limits.vocab_size,
            limits.max_context,
            limits.max_probe_k,
        )
        if out is not None:  # None: arrays that do not fit together, which the numpy code refuses
            if len(out) == 2:
                raise RequestRejected(*out)
            return tuple(out)
    return _plan_arrays_numpy(fwd, limits)


def _plan_arrays_numpy(fwd: Forward, limits: CacheLimits) -> _PlanArrays:
    num_tokens, num_pages, kv_len = _check(fwd, limits)
    ps = limits.page_size
    n_req = len(num_tokens)
    tok_ptr = fwd.token_indptr.astype(np.int64)
    page_ptr = fwd.page_indptr.astype(np.int64)
    token_request = np.repeat(np.arange(n_req), num_tokens)
    # A request's new tokens take the last num_tokens of its kv_len slots, in order.
    q_slot = (kv_len - num_tokens - tok_ptr[:-1])[token_request] + np.arange(len(token_request))
    slots = fwd.pages[page_ptr[:-1][token_request] + q_slot // ps].astype(np.int64) * ps + q_slot % ps
    tq = max(int(num_tokens.max()) if n_req else 1, 1)
    col = np.arange(tq)
    q_valid = col[None, :] < num_tokens[:, None]
    q_index = np.where(q_valid, tok_ptr[:-1, None] + col[None, :], 0)
    max_pages = max(int(num_pages.max()) if n_req else 1, 1)
    page_col = np.arange(max_pages)
    page_table = np.zeros((n_req, max_pages), dtype=np.int32)
    if fwd.pages.size:
        at = np.minimum(page_ptr[:-1, None] + page_col, fwd.pages.size - 1)
        page_table = np.where(page_col < num_pages[:, None], fwd.pages[at], 0).astype(np.int32)
    out_tokens = np.repeat(tok_ptr[:-1], _counts(fwd.out_indptr)) + fwd.out_rows.astype(np.int64)
    tokens, positions = fwd.tokens.astype(np.int64), fwd.positions.astype(np.int64)
    return (
        num_tokens,
        kv_len,
        token_request,
        q_slot,
        slots,
        q_valid,
        q_index,
        page_table,
        out_tokens,
        tok_ptr[:-1],
        tokens,
        positions,
    )


def build_plan(fwd: Forward, limits: CacheLimits, device: torch.device) -> PassPlan:
    """The pass's tensors (from `_plan_arrays`), and its user mask where it has one."""
    (num_tokens, kv_len, token_request, q_slot, slots, q_valid, q_index, page_table, out_tokens, q_start, tokens,
     positions) = _plan_arrays(fwd, limits)
    check_mask_rows(fwd.mask_req_indptr, fwd.mask_row_indptr, fwd.mask_runs, num_tokens, kv_len)

    def t(a: npt.NDArray[np.generic], dtype: torch.dtype = torch.long) -> torch.Tensor:
        # Arrays decoded from a frame are read-only views of it; torch wants writable memory.
        tensor = torch.from_numpy(a if a.flags.writeable else a.copy())
        return tensor if tensor.dtype == dtype and device.type == "cpu" else tensor.to(device=device, dtype=dtype)

    user_mask = None
    if fwd.mask_runs.size or int(fwd.mask_req_indptr[-1]) > 0:
        max_kv = max(int(kv_len.max()), 1)
        rows = decode_brle_rows(t(fwd.mask_row_indptr), t(fwd.mask_runs), max_kv)
        user_mask = torch.ones(len(token_request), max_kv, dtype=torch.bool, device=device)
        row_ptr = fwd.mask_req_indptr.astype(np.int64)
        masked_tokens = np.concatenate(
            [q_start[r] + np.arange(num_tokens[r]) for r in range(len(num_tokens)) if row_ptr[r + 1] > row_ptr[r]]
        )
        user_mask[t(masked_tokens)] = rows
    return PassPlan(
        tokens=t(tokens),
        positions=t(positions),
        slots=t(slots),
        q_slot=t(q_slot),
        token_request=t(token_request),
        q_index=t(q_index),
        q_valid=t(q_valid, torch.bool),
        kv_len=t(kv_len),
        num_q=t(num_tokens),
        q_start=t(q_start),
        page_table=t(page_table, torch.int32),
        user_mask=user_mask,
        out_tokens=t(out_tokens),
        kv_len_np=kv_len,
        num_q_np=num_tokens,
        page_table_np=page_table,
        q_slot_np=q_slot,
        q_index_np=q_index,
        q_valid_np=q_valid,
        out_tokens_np=out_tokens,
        sampling=plan_sampling(fwd, limits.vocab_size, device),
    )


def family_keys(plan: PassPlan, window: int, num_sinks: int, page_size: int) -> FamilyKeys:
    """The keys a family with `window` (0 = full) reads, and its mask rebuilt for those keys.

    A windowed family reads only the sink slots and the slots some query of the request can still
    see, so its key count differs from kv_len: the user mask (defined over kv_len keys) is
    gathered at the real key slots rather than reused positionally. The keys and the causal,
    window and sink masks come from C++ once the kernels are loaded (`pass_plan.cpp`, one call),
    else from numpy, a few whole-array operations for every request at once (the same arrays: a
    decode step makes them once a pass, on the host between two forward passes)."""
    if window in plan.families:
        return plan.families[window]
    device = plan.tokens.device
    native = cpu_kernels.pass_planner()
    if native is not None:
        arrays = native.family_arrays(
            plan.kv_len_np,
            plan.num_q_np,
            plan.page_table_np,
            plan.q_slot_np,
            plan.q_index_np,
            plan.q_valid_np,
            window,
            num_sinks,
            page_size,
        )
    else:
        arrays = _family_arrays_numpy(plan, window, num_sinks, page_size)
    index, slot, allowed_np, empty_np, safe_np = (torch.from_numpy(a).to(device) for a in arrays)
    if plan.user_mask is None:
        allowed, empty, safe = allowed_np, empty_np, safe_np
    else:
        user = plan.user_mask[plan.q_index]  # [B, Tq, max_kv]
        gathered = torch.gather(user, 2, slot.clamp(min=0)[:, None, :].expand(-1, user.shape[1], -1))
        allowed = allowed_np & gathered
        empty = ~allowed.any(-1)
        safe = allowed | empty[..., None]
    fam = FamilyKeys(window, index, slot, allowed, empty, safe)
    plan.families[window] = fam
    return fam


def _family_arrays_numpy(
    plan: PassPlan, window: int, num_sinks: int, page_size: int
) -> tuple[npt.NDArray[np.generic], ...]:
    """A family's (index, slot, allowed, empty, safe) before the user mask, in numpy."""
    kv, nq = plan.kv_len_np, plan.num_q_np
    # Request r reads its first `sinks[r]` slots, then slots start[r] .. kv[r] - 1.
    start = np.maximum(kv - nq - window + 1, 0) if window else np.zeros_like(kv)
    sinks = np.minimum(num_sinks, start)
    count = sinks + kv - start
    width = max(int(count.max()) if len(count) else 1, 1)
    col = np.arange(width)
    slot = np.where(col < sinks[:, None], col, start[:, None] + col - sinks[:, None])
    slot = np.where(col < count[:, None], slot, -1)  # [B, K], -1 for padding
    safe_slot = np.maximum(slot, 0)
    rows = np.arange(len(kv))[:, None]
    pages = plan.page_table_np[rows, safe_slot // page_size].astype(np.int64)
    index = np.where(slot >= 0, pages * page_size + safe_slot % page_size, 0)
    q_slot = np.full(plan.q_index_np.shape, -1)  # [B, Tq]
    q_slot[plan.q_valid_np] = plan.q_slot_np[plan.q_index_np[plan.q_valid_np]]
    ks, qs = slot[:, None, :], q_slot[:, :, None]
    allowed = (ks >= 0) & (ks <= qs)
    if window:
        allowed &= (ks > qs - window) | (ks < num_sinks)
    empty = ~allowed.any(-1)
    return index, slot, allowed, empty, allowed | empty[..., None]
