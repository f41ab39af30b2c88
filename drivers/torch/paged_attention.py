"""The `Attend` callable the model calls once per layer: store the new tokens' K/V in the paged
cache, then attend through the backend chosen by device (plain torch on the CPU, Triton on CUDA).
Owns the per-layer choice of attention family (full or windowed)."""

from __future__ import annotations

import torch

from drivers.torch.attention_ref import masked_attention
from drivers.torch.batch_plan import PassPlan, family_keys
from drivers.torch.config import ModelConfig
from drivers.torch.kv_cache import PagedKVCache


class PagedAttention:
    def __init__(self, cfg: ModelConfig, cache: PagedKVCache, plan: PassPlan, use_triton: bool) -> None:
        self.cfg = cfg
        self.cache = cache
        self.plan = plan
        self.use_triton = use_triton

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan, cache = self.plan, self.cache
        cache.write(layer, plan.slots, k, v)
        window = self.cfg.window(layer)
        if self.use_triton:
            from drivers.torch.attention_triton import paged_attention

            return paged_attention(
                q,
                cache.k[layer],
                cache.v[layer],
                plan,
                cache.page_size,
                self.cfg.scale,
                window,
                self.cfg.num_sink_tokens if window else 0,
            )
        fam = family_keys(plan, window, self.cfg.num_sink_tokens, cache.page_size)
        keys, values = cache.gather(layer, fam.key_index)
        qp = q[plan.q_index]  # [B, Tq, H, D]
        out = masked_attention(qp, keys, values.to(q.dtype), fam.safe_mask, self.cfg.scale, fam.empty)
        return out[plan.q_valid]  # padded rows dropped; valid rows are in flat token order
