"""RoPE kinds, in one place: which a checkpoint's config asks for (`hf_rope_fields`) and the
inverse frequencies each kind gives (`rope_inv_freq`, `model_inv_freqs`). Applying them is the
model's (`model.apply_rope`); the kinds supported are "default" and "llama3", over all of each
head or its first `rotary_dim` dims."""

from __future__ import annotations

import math
from typing import Any

import torch

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig

SUPPORTED = ("default", "llama3")


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


def model_inv_freqs(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 inverse frequencies of full-attention and of windowed layers."""
    local = rope_inv_freq(cfg.rope_dim, cfg.rope_local_theta or cfg.rope_theta)
    return rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_llama3), local


def hf_rope_fields(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """`ModelConfig`'s RoPE fields from a Hugging Face config.json: `rope_theta`, `rope_llama3`,
    `rope_local_theta` (the windowed layers' base where the config names one; 0 = the same) and
    `rotary_dim` (from `partial_rotary_factor`, as transformers rounds it).
    transformers >= 5 writes `rope_parameters` (per layer type for Gemma 3); older configs write
    `rope_theta`, `rope_local_base_freq` and `rope_scaling`. A kind not in SUPPORTED is refused
    naming what the config asked for."""
    rope = raw.get("rope_parameters") or {}
    rope_global = rope.get("full_attention", rope)
    rope_local = rope.get("sliding_attention", {})
    llama3 = None
    for params in (rope_global, rope_local, raw.get("rope_scaling") or {}):
        kind = params.get("rope_type", params.get("type"))
        if kind == "llama3":
            llama3 = (
                float(params["factor"]),
                float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                int(params["original_max_position_embeddings"]),
            )
        elif kind not in (None, "default"):
            raise ConfigRejected(f"RoPE scaling {params} is not supported yet ({', '.join(SUPPORTED)})", "model")
    local = rope_local.get("rope_theta", raw.get("rope_local_base_freq", 0.0))
    fraction = float(rope_global.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    return {
        "rotary_dim": int(head_dim * fraction) if fraction != 1.0 else 0,
        "rope_theta": float(rope_global.get("rope_theta", raw.get("rope_theta", 10000.0))),
        "rope_llama3": llama3,
        "rope_local_theta": float(local),
    }
