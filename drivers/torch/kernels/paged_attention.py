"""The `Attend` callable the model calls once per layer: store the new tokens' K/V in the paged
cache, then attend through the backend chosen by device (plain torch on the CPU, Triton on CUDA).
Owns the per-layer choice of attention family (full or windowed), and the tensors one layer's
CPU attention reads (`LayerKeys`), which the compiled path passes into its compiled layer."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from drivers.torch.batch_plan import PassPlan, family_keys
from drivers.torch.config import ModelConfig
from drivers.torch.kernels.attention_ref import masked_attention
from drivers.torch.kv_cache import PagedKVCache


class LayerKeys(NamedTuple):
    """Everything CPU attention of one layer reads besides q, k, v (all tensors: a compiled layer
    takes it as an argument)."""

    k_cache: torch.Tensor  # [S, Hkv, D] this layer's pages
    v_cache: torch.Tensor
    slots: torch.Tensor  # [T] where each new token's k/v goes
    q_index: torch.Tensor  # [B, Tq] flat token of each padded query
    key_index: torch.Tensor  # [B, K] cache slot of each key
    mask: torch.Tensor  # [B, Tq, K] bool, empty rows opened to every key
    empty: torch.Tensor  # [B, Tq] rows that attend to nothing (zeroed)
    valid: torch.Tensor  # [T] row of each token in the flattened [B * Tq] layout


def attend_keys(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: LayerKeys,
    scale: float,
    fused_decode: bool = False,
    kernel: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write k/v [T, Hkv, D] into the cache, attend q [T, H, D] over the keys -> [T, H, D].
    With one query per request: `kernel` (float32 on the CPU, `cpu_kernels` loaded) runs the C++
    decode attention, which reads the keys in place; else `fused_decode` (for compiled layers)
    runs attention as gather, multiply and sum, which Inductor fuses without materializing the
    gathered keys. `softcap` (Gemma 2's attention logit cap) runs only in `masked_attention`: the
    callers keep `kernel` and `fused_decode` off for it."""
    keys.k_cache.index_copy_(0, keys.slots, k.to(keys.k_cache.dtype))
    keys.v_cache.index_copy_(0, keys.slots, v.to(keys.v_cache.dtype))
    decode = keys.q_index.shape[1] == 1
    if decode and kernel and not softcap:
        out = torch.ops.wafer.decode_attention(
            q[keys.q_index[:, 0]], keys.k_cache, keys.v_cache, keys.key_index, keys.mask[:, 0], keys.empty[:, 0], scale
        )
    elif decode and fused_decode and not softcap:
        out = _decode_attention(q, keys, scale)
    else:
        out = masked_attention(
            q[keys.q_index],
            keys.k_cache[keys.key_index].to(q.dtype),
            keys.v_cache[keys.key_index].to(q.dtype),
            keys.mask,
            scale,
            keys.empty,
            softcap,
        )
    return out.reshape(-1, *q.shape[1:])[keys.valid]


def _decode_attention(q: torch.Tensor, keys: LayerKeys, scale: float) -> torch.Tensor:
    """`masked_attention` for one query per request, as reductions: -> [B, 1, H, D]."""
    qp = q[keys.q_index[:, 0]]  # [B, H, D]
    b, h, d = qp.shape
    k = keys.k_cache[keys.key_index].to(q.dtype)  # [B, K, Hkv, D]
    v = keys.v_cache[keys.key_index].to(q.dtype)
    groups = h // k.shape[2]
    # Reductions over D, then over keys (dim 1): the layout Inductor vectorized best here.
    scores = (qp.reshape(b, 1, -1, groups, d) * k[:, :, :, None, :]).sum(-1) * scale  # [B, K, Hkv, G]
    scores = scores.masked_fill(~keys.mask[:, 0, :, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=1)
    out = (weights[..., None] * v[:, :, :, None, :]).sum(1)  # [B, Hkv, G, D]
    return out.reshape(b, 1, h, d).masked_fill(keys.empty[..., None, None], 0.0)


_FamilyTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class PagedAttention:
    """`for_compiled=True` pads layouts (with masked-out entries) so that a compiled layer sees few
    distinct size patterns: keys always 2 or more, and requests 2 or more when the pass has more
    than one token. Dynamo specializes sizes 0 and 1, so a compiled layer then needs three graphs:
    one token; one token per request (decode batches); the rest."""

    def __init__(
        self,
        cfg: ModelConfig,
        cache: PagedKVCache,
        plan: PassPlan,
        use_triton: bool,
        for_compiled: bool = False,
        kernel: bool = False,
    ) -> None:
        self.cfg = cfg
        self.cache = cache
        self.plan = plan
        self.use_triton = use_triton
        self.for_compiled = for_compiled
        self.kernel = kernel  # decode passes run `torch.ops.wafer.decode_attention` (see attend_keys)
        self._families: dict[int, _FamilyTensors] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from drivers.torch.kernels.attention_triton import paged_attention

            plan, cache = self.plan, self.cache
            cache.write(layer, plan.slots, k, v)
            window = self.cfg.window(layer)
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
        keys = self.layer_keys(layer)
        return attend_keys(q, k, v, keys, self.cfg.scale, kernel=self.kernel, softcap=self.cfg.attn_logit_softcap)

    def layer_keys(self, layer: int) -> LayerKeys:
        cache = self.cache
        return LayerKeys(cache.k_layers[layer], cache.v_layers[layer], *self.family_keys(self.cfg.window(layer)))

    def family_keys(self, window: int) -> tuple[torch.Tensor, ...]:
        """`LayerKeys` past the cache (slots, q_index, key_index, mask, empty, valid) of every layer
        with this window (0: full attention): the same tensors for all of them."""
        if window not in self._families:
            self._families[window] = self._family_tensors(window)
        return (self.plan.slots, *self._families[window])

    def _family_tensors(self, window: int) -> _FamilyTensors:
        plan = self.plan
        fam = family_keys(plan, window, self.cfg.num_sink_tokens, self.cache.page_size)
        q_index, key_index, mask, empty = plan.q_index, fam.key_index, fam.safe_mask, fam.empty
        b, num_keys = q_index.shape[0], key_index.shape[1]
        pad_k = max(2 - num_keys, 0) if self.for_compiled else 0
        pad_b = max(2 - b, 0) if self.for_compiled and len(plan.tokens) > 1 else 0
        # `q_index` stays the plan's own tensor unless requests are padded: the compiled stack
        # takes every family's, and dynamo guards on which of its inputs alias each other.
        if pad_b:
            q_index = F.pad(q_index, (0, 0, 0, pad_b))
            empty = F.pad(empty, (0, 0, 0, pad_b), value=True)
        if pad_b or pad_k:
            key_index = F.pad(key_index, (0, pad_k, 0, pad_b))
            mask = F.pad(mask, (0, pad_k, 0, 0, 0, pad_b), value=False) | empty[..., None]
        valid = np.flatnonzero(plan.q_valid_np)  # [b, tq] in row order: the valid rows' flat index
        return q_index, key_index, mask, empty, torch.from_numpy(valid).to(q_index.device)
