"""The transformer math, nothing else (gpt-fast style): Llama- and Gemma-style decoder blocks over
a flat token batch. Attention over the paged cache and LoRA deltas come in as callables, so this
file knows nothing of pages, masks, requests or checkpoint formats. Parameter names follow
Hugging Face's so a checkpoint's state dict loads as is."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from drivers.torch.config import ModelConfig

# attend(layer, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H, D]: stores k/v, attends.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LoraDelta(Protocol):
    def __call__(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA contribution to projection `name` of `layer` for input rows `x`, or None."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        # Gemma stores w - 1 (its norm multiplies by 1 + w); Llama stores w.
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op where the reference order allows it (a decode step runs 61 of these).
        shape = (x.shape[-1],)
        if self.offset:  # Gemma multiplies by (1 + w) in float32 before casting back
            return F.rms_norm(x.float(), shape, self.offset + self.weight.float(), self.eps).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Llama normalizes in float32, casts back, then multiplies by the weight in the low dtype.
        out: torch.Tensor = self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)
        return out


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
            self.q_norm = RMSNorm(d, cfg.rms_eps, 1.0)
            self.k_norm = RMSNorm(d, cfg.rms_eps, 1.0)
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
    mlp: MLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        offset = 1.0 if cfg.arch == "gemma" else 0.0
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, offset)
        if cfg.arch == "gemma":
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, offset)


class Decoder(nn.Module):
    embed_tokens: nn.Embedding
    norm: RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, 1.0 if cfg.arch == "gemma" else 0.0)

    def blocks(self) -> list[Block]:
        return [b for b in self.layers if isinstance(b, Block)]


def rope_inv_freq(head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies, computed in float32 exactly as transformers does. `llama3` =
    (factor, low_freq_factor, high_freq_factor, original_max_position) for Llama 3.1+ scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if llama3 is None:
        return inv
    factor, low, high, original = llama3
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, D] for rotate-half RoPE, computed in float32 like transformers."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_llama3), persistent=False)
        local = cfg.rope_local_theta or cfg.rope_theta
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg.head_dim, local), persistent=False)

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def _proj(self, lin: nn.Module, layer: int, name: str, x: torch.Tensor, lora: LoraDelta | None) -> torch.Tensor:
        y: torch.Tensor = lin(x)
        if lora is not None:
            delta = lora(layer, name, x)
            if delta is not None:
                y = y + delta
        return y

    def _qkv(
        self, attn: Attention, layer: int, h: torch.Tensor, lora: LoraDelta | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, n = self.cfg, h.shape[0]
        names = ("q_proj", "k_proj", "v_proj")
        if attn.qkv is None:
            parts = [self._proj(getattr(attn, name), layer, name, h, lora) for name in names]
        else:
            q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            parts = list(attn.qkv(h).split((q_size, kv_size, kv_size), dim=-1))
            if lora is not None:
                deltas = [lora(layer, name, h) for name in names]
                parts = [p if d is None else p + d for p, d in zip(parts, deltas, strict=True)]
        q, k, v = parts
        return (
            q.reshape(n, cfg.num_heads, cfg.head_dim),
            k.reshape(n, cfg.num_kv_heads, cfg.head_dim),
            v.reshape(n, cfg.num_kv_heads, cfg.head_dim),
        )

    def _gate_up(
        self, mlp: MLP, layer: int, h: torch.Tensor, lora: LoraDelta | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if mlp.gate_up is None:
            gate = self._proj(mlp.gate_proj, layer, "gate_proj", h, lora)
            return gate, self._proj(mlp.up_proj, layer, "up_proj", h, lora)
        gate, up = mlp.gate_up(h).chunk(2, dim=-1)
        if lora is not None:
            dg, du = lora(layer, "gate_proj", h), lora(layer, "up_proj", h)
            gate = gate if dg is None else gate + dg
            up = up if du is None else up + du
        return gate, up

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        rows: torch.Tensor,
        lora: LoraDelta | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        gemma = cfg.arch == "gemma"
        x = self.model.embed_tokens(tokens)
        if gemma:  # Gemma scales embeddings by sqrt(hidden), rounded to the activation dtype
            x = x * torch.tensor(math.sqrt(cfg.hidden_size), dtype=x.dtype)
        n = tokens.shape[0]
        cos_g, sin_g = rope_cos_sin(self.inv_freq, positions, x.dtype)
        cos_l, sin_l = rope_cos_sin(self.inv_freq_local, positions, x.dtype)
        for i, block in enumerate(self.model.blocks()):
            attn = block.self_attn
            h = block.input_layernorm(x)
            q, k, v = self._qkv(attn, i, h, lora)
            if cfg.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            local = cfg.window(i) > 0
            cos, sin = (cos_l, sin_l) if local else (cos_g, sin_g)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = attend(i, q, k, v).reshape(n, cfg.num_heads * cfg.head_dim)
            o = self._proj(attn.o_proj, i, "o_proj", o, lora)
            if gemma:
                x = x + block.post_attention_layernorm(o)
                h = block.pre_feedforward_layernorm(x)
            else:
                x = x + o
                h = block.post_attention_layernorm(x)
            mlp = block.mlp
            gate, up = self._gate_up(mlp, i, h, lora)
            act = F.gelu(gate, approximate="tanh") if gemma else F.silu(gate)
            m = self._proj(mlp.down_proj, i, "down_proj", act * up, lora)
            x = x + (block.post_feedforward_layernorm(m) if gemma else m)
        x = self.model.norm(x[rows])
        head = self.output_head
        logits = (head(x) if head is not None else F.linear(x, self.output_weight())).float()
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits
