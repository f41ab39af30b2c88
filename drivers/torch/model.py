"""The transformer math, nothing else (gpt-fast style): Llama- and Gemma-style decoder blocks over
a flat token batch, with the families' switches of `ModelConfig`. Attention over the paged cache
and LoRA deltas come in as callables, so this file knows nothing of pages, masks, requests or
checkpoint formats. Parameter names follow Hugging Face's so a checkpoint's state dict loads as is."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from drivers.errors import Unsupported
from drivers.torch.config import ModelConfig
from drivers.torch.moe import MoE
from drivers.torch.rope import model_attention_factors, model_inv_freqs

# attend(layer, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]: stores k/v, attends.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, D]
# reduce(partial [T, hidden]) -> the sum over tensor-parallel ranks (`tensor_parallel.py`).
Reduce = Callable[[torch.Tensor], torch.Tensor]


class LoraDelta(Protocol):
    def __call__(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA contribution to projection `name` of `layer` for input rows `x`, or None."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float, weight_in_float32: bool = False) -> None:
        super().__init__()
        # Gemma stores w - 1 (its norm multiplies by 1 + w); Llama stores w.
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.weight_in_float32 = weight_in_float32 or bool(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op where the reference order allows it (a decode step runs 61 of these).
        shape = (x.shape[-1],)
        if self.weight_in_float32:  # Gemma (by 1 + w) and OLMo 2 multiply in float32, then cast back
            return F.rms_norm(x.float(), shape, self.offset + self.weight.float(), self.eps).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Llama normalizes in float32, casts back, then multiplies by the weight in the low dtype.
        out: torch.Tensor = self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)
        return out


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_eps, cfg.norm_offset, cfg.norm_weight_in_float32)


class Attention(nn.Module):
    q_proj: nn.Module  # nn.Linear, or Int8Linear after quantization
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: RMSNorm
    k_norm: RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            whole = cfg.qk_norm == "projection"
            self.q_norm = _norm(cfg, h * d if whole else d)
            self.k_norm = _norm(cfg, kv * d if whole else d)
        self.qkv: nn.Module | None = None  # set by `fusion.fuse_projections`: q, k, v in one matmul


class MLP(nn.Module):
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: nn.Module | None = None  # set by `fusion.fuse_projections`


class Block(nn.Module):
    self_attn: Attention
    mlp: MLP | MoE
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg)
        if cfg.has_pre_norms:
            self.input_layernorm = _norm(cfg, cfg.hidden_size)
        # Llama: the norm before the MLP; Gemma and OLMo 2: the norm of the attention output.
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        if cfg.arch == "gemma":
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        if cfg.has_post_norms:
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)


class Decoder(nn.Module):
    embed_tokens: nn.Embedding
    norm: RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, cfg.hidden_size)

    def blocks(self) -> list[Block]:
        return [b for b in self.layers if isinstance(b, Block)]


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, D] for rotate-half RoPE times the kind's attention `factor` (YaRN,
    LongRoPE), computed in float32 like transformers."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of the first cos.shape[-1] dims of x; the others pass unchanged."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def layer_rope(cfg: ModelConfig, layer: int, rope_full: Rope, rope_local: Rope) -> Rope | tuple[None, None]:
    """The (cos, sin) a layer rotates q and k by: its attention family's, or (None, None) for a
    layer without RoPE."""
    if not cfg.has_rope(layer):
        return None, None
    return rope_local if cfg.window(layer) > 0 else rope_full


def _times(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


# The LoRA delta of one layer: (projection name, input rows) -> delta or None.
LayerLora = Callable[[str, torch.Tensor], torch.Tensor | None]


def _proj(lin: nn.Module, name: str, x: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
    y: torch.Tensor = lin(x)
    if lora is not None:
        delta = lora(name, x)
        if delta is not None:
            y = y + delta
    return y


def _fused(
    fused: nn.Module, names: tuple[str, ...], sizes: tuple[int, ...], h: torch.Tensor, lora: LayerLora | None
) -> list[torch.Tensor]:
    parts = list(fused(h).split(sizes, dim=-1))
    if lora is not None:
        deltas = [lora(name, h) for name in names]
        parts = [p if d is None else p + d for p, d in zip(parts, deltas, strict=True)]
    return parts


def attention_inputs(
    cfg: ModelConfig,
    block: Block,
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    lora: LayerLora | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense work of a layer before attention: norm, q/k/v projections, q/k norms, RoPE
    (none where `cos` is None)."""
    attn, n = block.self_attn, x.shape[0]
    h = block.input_layernorm(x) if cfg.has_pre_norms else x
    names = ("q_proj", "k_proj", "v_proj")
    if attn.qkv is None:
        q, k, v = (_proj(getattr(attn, name), name, h, lora) for name in names)
    else:
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = _fused(attn.qkv, names, (q_size, kv_size, kv_size), h, lora)
    if cfg.qk_norm == "projection":
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = q.reshape(n, cfg.num_heads, cfg.head_dim)
    k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm == "head":
        q, k = attn.q_norm(q), attn.k_norm(k)
    if cos is None or sin is None:
        return q, k, v
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output(
    cfg: ModelConfig,
    block: Block,
    x: torch.Tensor,
    o: torch.Tensor,
    lora: LayerLora | None,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """The dense work of a layer after attention: output projection, residuals, norms, MLP. With
    `reduce`, o and down are row-parallel shards whose outputs (LoRA deltas included) are partial."""
    gemma = cfg.arch == "gemma"
    o = _proj(block.self_attn.o_proj, "o_proj", o.reshape(x.shape[0], cfg.num_heads * cfg.head_dim), lora)
    if reduce is not None:
        o = reduce(o)
    if cfg.has_post_norms:
        o = block.post_attention_layernorm(o)
    x = x + _times(o, cfg.residual_multiplier)
    if gemma:
        h = block.pre_feedforward_layernorm(x)
    else:
        h = block.post_attention_layernorm(x) if cfg.has_pre_norms else x
    m = _moe(cfg, block.mlp, h, lora) if isinstance(block.mlp, MoE) else _mlp(cfg, block.mlp, h, lora)
    if reduce is not None:
        m = reduce(m)
    if cfg.has_post_norms:
        m = block.post_feedforward_layernorm(m)
    return x + _times(m, cfg.residual_multiplier)


def _mlp(cfg: ModelConfig, mlp: MLP, h: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
    if mlp.gate_up is None:
        gate, up = _proj(mlp.gate_proj, "gate_proj", h, lora), _proj(mlp.up_proj, "up_proj", h, lora)
    else:
        size = cfg.intermediate_size
        gate, up = _fused(mlp.gate_up, ("gate_proj", "up_proj"), (size, size), h, lora)
    act = F.gelu(gate, approximate="tanh") if cfg.arch == "gemma" else F.silu(gate)
    return _proj(mlp.down_proj, "down_proj", act * up, lora)


def _moe(cfg: ModelConfig, moe: MoE, h: torch.Tensor, lora: LayerLora | None) -> torch.Tensor:
    if lora is not None:  # an adapter's MLP deltas fit no expert: refused, never dropped
        probes = {"gate_proj": h, "up_proj": h, "down_proj": h.new_zeros(h.shape[0], cfg.intermediate_size)}
        if any(lora(name, x) is not None for name, x in probes.items()):
            raise Unsupported("LoRA on the MLP of a mixture-of-experts layer is not supported", "adapter_id")
    return moe(h)


def output_logits(cfg: ModelConfig, norm: RMSNorm, head: nn.Module | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Final norm and output head (a module, or the weight of a plain linear), float32 logits."""
    x = norm(x)
    logits = (F.linear(x, head) if isinstance(head, torch.Tensor) else head(x)).float()
    if cfg.logits_scaling != 1.0:
        logits = logits / cfg.logits_scaling
    if cfg.final_logit_softcap:
        logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return logits


class Transformer(nn.Module):
    """`forward(tokens, positions, attend, rows, lora)` -> logits of the selected `rows` only."""

    model: Decoder
    lm_head: nn.Linear
    inv_freq: torch.Tensor
    inv_freq_local: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Set by weight transforms (e.g. int8 quantization) that replace the output projection.
        self.output_head: nn.Module | None = None
        # Set on a tensor-parallel shard: sums the row-parallel projections' outputs over ranks.
        self.reduce: Reduce | None = None
        inv_freq, inv_freq_local = model_inv_freqs(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("inv_freq_local", inv_freq_local, persistent=False)

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope, Rope]:
        """Token embeddings and the RoPE (cos, sin) of full-attention and of windowed layers."""
        cfg = self.cfg
        x = self.model.embed_tokens(tokens)
        if cfg.arch == "gemma":  # Gemma scales embeddings by sqrt(hidden), rounded to the activation dtype
            x = x * torch.tensor(math.sqrt(cfg.hidden_size), dtype=x.dtype)
        x = _times(x, cfg.embedding_multiplier)
        factor, factor_local = model_attention_factors(cfg)
        rope = rope_cos_sin(self.inv_freq, positions, x.dtype, factor)
        has_local = any(w > 0 for w in cfg.layer_windows)
        return x, rope, rope_cos_sin(self.inv_freq_local, positions, x.dtype, factor_local) if has_local else rope

    def head(self) -> nn.Module | torch.Tensor:
        """The output projection: a module, or the weight of a plain linear (tied or not)."""
        return self.output_head if self.output_head is not None else self.output_weight()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        rows: torch.Tensor,
        lora: LoraDelta | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        x, rope_full, rope_local = self.embed(tokens, positions)
        for i, block in enumerate(self.model.blocks()):
            layer_lora = None if lora is None else functools.partial(lora, i)
            cos, sin = layer_rope(cfg, i, rope_full, rope_local)
            q, k, v = attention_inputs(cfg, block, x, cos, sin, layer_lora)
            x = attention_output(cfg, block, x, attend(i, q, k, v), layer_lora, self.reduce)
        return output_logits(cfg, self.model.norm, self.head(), x[rows])
