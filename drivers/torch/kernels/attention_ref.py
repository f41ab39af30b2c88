"""The plain-torch reference attention over the paged cache: gather each request's keys into a
padded tensor and run one `scaled_dot_product_attention` with a boolean mask. It is the CPU path
and the yardstick the Triton kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drivers.torch.errors import MaskShapeError


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    empty: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [B, Tq, H, D], k/v [B, K, Hkv, D], mask [B, Tq, K] (True = attend) -> [B, Tq, H, D].
    `softcap` > 0 (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask.

    The mask must cover exactly the keys given: a mismatch is an error, never a broadcast or a
    silent drop. Rows that may attend to nothing (padding) come out as zeros, not NaN. A caller
    that already knows those rows passes `empty` [B, Tq] (None = compute them here) with a mask
    whose empty rows were made safe."""
    b, tq, _, _ = q.shape
    if mask.shape != (b, tq, k.shape[1]):
        raise MaskShapeError(f"mask {tuple(mask.shape)} does not cover queries {tq} x keys {k.shape[1]}")
    if empty is None:
        empty = ~mask.any(-1)  # [B, Tq]
        mask = mask | empty[..., None]
    if softcap > 0:
        return _softcapped(q, k, v, mask, scale, softcap).masked_fill(empty[..., None, None], 0.0)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    ).transpose(1, 2)
    return out.masked_fill(empty[..., None, None], 0.0)


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with capped scores, in transformers' order (SDPA has no cap): -> [B, Tq, H, D]."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", weights, v)
