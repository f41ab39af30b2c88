# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernel arguments are untyped by design: pointers and constexprs.)
"""Paged attention as a Triton kernel for CUDA: queries of one request in blocks of BLOCK_M
tokens, one query head per program, keys streamed page by page with an online softmax. Causal
masking, per-row user masks (dense, decoded on the device), sliding windows, sink tokens and GQA.
Tested against `attention_ref` through Triton's interpreter (fp32/fp16, small shapes)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from drivers.torch.batch_plan import PassPlan

BLOCK_M = 16  # query tokens per program; tl.dot needs >= 16 on GPUs
BLOCK_N = 32  # keys per step


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    mask_ptr,
    q_slot_ptr,
    block_ptr,
    kv_len_ptr,
    page_table_ptr,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_mt,
    stride_pt,
    scale,
    page_size,
    window,
    num_sinks,
    group,
    head_dim,
    HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    blk = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    req = tl.load(block_ptr + blk * 3)
    t0 = tl.load(block_ptr + blk * 3 + 1)
    t1 = tl.load(block_ptr + blk * 3 + 2)
    kv_len = tl.load(kv_len_ptr + req)

    rows = t0 + tl.arange(0, BLOCK_M)
    row_ok = rows < t1
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_slot = tl.load(q_slot_ptr + rows, mask=row_ok, other=0)
    first_slot = tl.load(q_slot_ptr + t0)
    last_slot = tl.load(q_slot_ptr + t1 - 1)

    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    lo = 0
    if window > 0:
        lo = tl.maximum(first_slot - window + 1, 0)
    hi = tl.minimum(last_slot + 1, kv_len)
    sink_hi = tl.minimum(num_sinks, lo)
    # Two key ranges: the sink slots before the window, then the slots some query can see.
    n_sink_steps = tl.cdiv(sink_hi, BLOCK_N)
    n_steps = n_sink_steps + tl.cdiv(hi - lo, BLOCK_N)
    for step in range(0, n_steps):
        if step < n_sink_steps:
            start = step * BLOCK_N
            end = sink_hi
        else:
            start = lo + (step - n_sink_steps) * BLOCK_N
            end = hi
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        page = tl.load(page_table_ptr + req * stride_pt + keys // page_size, mask=key_ok, other=0)
        slot = page * page_size + keys % page_size
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        allowed = key_ok[None, :] & row_ok[:, None] & (keys[None, :] <= q_slot[:, None])
        if window > 0:
            allowed = allowed & ((keys[None, :] > q_slot[:, None] - window) | (keys[None, :] < num_sinks))
        if HAS_MASK:
            um = tl.load(
                mask_ptr + rows[:, None] * stride_mt + keys[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0
            )
            allowed = allowed & (um != 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def query_blocks(plan: PassPlan, block_m: int = BLOCK_M) -> torch.Tensor:
    """[NB, 3] (request, first token, end token) tiling every request's queries in blocks."""
    cached = plan.query_blocks.get(block_m)
    if cached is not None:
        return cached
    starts = plan.q_start.cpu().numpy()
    out = [
        (r, int(starts[r]) + b, int(starts[r]) + min(b + block_m, n))
        for r, n in enumerate(plan.num_q_np.tolist())
        for b in range(0, n, block_m)
    ]
    blocks = torch.as_tensor(np.array(out, dtype=np.int32).reshape(-1, 3), device=plan.tokens.device)
    plan.query_blocks[block_m] = blocks
    return blocks


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PassPlan,
    page_size: int,
    scale: float,
    window: int,
    num_sinks: int,
) -> torch.Tensor:
    """q [T, H, D]; k/v_cache [slots, Hkv, D] of one layer -> [T, H, D]."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    blocks = query_blocks(plan)
    if t == 0 or blocks.shape[0] == 0:
        return out
    q = q.contiguous()
    mask = plan.user_mask
    has_mask = mask is not None
    mask_arg = mask.to(torch.int8) if mask is not None else torch.zeros(1, 1, dtype=torch.int8, device=q.device)
    q_slot = plan.q_slot.to(torch.int32)
    kv_len = plan.kv_len.to(torch.int32)
    grid = (blocks.shape[0], h)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        mask_arg,
        q_slot,
        blocks,
        kv_len,
        plan.page_table,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        mask_arg.stride(0),
        plan.page_table.stride(0),
        scale,
        page_size,
        window,
        num_sinks,
        h // k_cache.shape[1],
        d,
        HAS_MASK=has_mask,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    return out
