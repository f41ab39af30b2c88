"""RoPE, in one place: the kind a checkpoint's config asks for (`hf_rope_fields`), and the inverse
frequencies and attention factor each kind gives (`rope_inv_freq`, `model_inv_freqs`,
`model_attention_factors`). Applying them is the model's (`model.rope_cos_sin`, `model.apply_rope`),
over all of each head or its first `rotary_dim` dims.

The kinds, each computed in float32 in the order of transformers' `modeling_rope_utils`:
"default" 1 / theta^(2i/d); "linear" the default divided by `factor`; "llama3" (Llama 3.1+) the
low frequencies divided by `factor`, smoothed between `low_freq_factor` and `high_freq_factor`;
"yarn" interpolated (divided by `factor`) below a ramp of dims set by `beta_fast`/`beta_slow` over
the original length and extrapolated (default) above it, with cos and sin times an attention
factor (0.1 ln(factor) + 1 unless the config gives one or `mscale`/`mscale_all_dim`); "longrope"
(Phi-3.5, Phi-4-mini) the default divided per dim by `short_factor` or `long_factor`, cos and sin
times sqrt(1 + ln(factor) / ln(original)); "dynamic" (NTK) a base grown with the sequence length.
Windowed layers take the full layers' RoPE unless the config gives them their own base
(`rope_local_theta`, Gemma 3), which is unscaled.

Lengths and the paged cache. transformers picks dynamic NTK's base and longrope's factors from
the length of the sequence in each forward call; this driver stores keys rotated, once, in pages
that later passes read, so it picks one set of frequencies for the model's life: transformers'
own for a sequence of `cfg.max_position` tokens, the longest context the driver serves (its
`max_context` is at most `max_position`).
- dynamic: transformers' base equals theta for sequences of up to `max_position_embeddings`, so
  here it is the default RoPE, equal to transformers for every sequence the driver runs (past
  that length transformers rescales per call, over keys its cache rotated before; not served).
- longrope: the long factors where `max_position` > `original_max_position_embeddings`, as vLLM
  decides at load; then equal to transformers for sequences longer than the original length.
  Shorter ones transformers rotates by the short factors (its Phi-3 `generate` even drops its
  cache and runs the prompt again when a sequence grows past the original length); here they
  keep the long ones, like vLLM, so that keys cached early stay valid as the context grows.
  Where `max_position` <= the original length, the short factors, equal for every sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from drivers.errors import ConfigRejected

if TYPE_CHECKING:
    from drivers.torch.config import ModelConfig

SUPPORTED = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A scaled RoPE kind and its parameters, as transformers resolves them from a config."""

    kind: str  # one of SUPPORTED other than "default"
    factor: float
    # The pretraining length (llama3, yarn, longrope); dynamic: `max_position_embeddings`, the
    # length its formula scales from.
    original_max_position: int
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: the ramp's bounds, in rotations over the original length
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's bounds rounded outwards to whole dims
    short_factor: tuple[float, ...] = ()  # longrope, one per rotated pair of dims
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # multiplies cos and sin (yarn, longrope)


def _default(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    factor, low, high, original = s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    extrapolated = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - extrapolated) + extrapolation * extrapolated


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None = None, seq_len: int = 0) -> torch.Tensor:
    """Float32 inverse frequencies of `dim` rotated dims for sequences of `seq_len` tokens (only
    dynamic NTK and longrope depend on it), computed as transformers' ROPE_INIT_FUNCTIONS do."""
    if scaling is None:
        return _default(dim, theta)
    s = scaling
    if s.kind == "linear":
        return _default(dim, theta) / s.factor
    if s.kind == "llama3":
        return _llama3(_default(dim, theta), s)
    if s.kind == "yarn":
        return _yarn(dim, theta, s)
    if s.kind == "longrope":
        factors = s.long_factor if seq_len > s.original_max_position else s.short_factor
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    assert s.kind == "dynamic", s.kind
    length, reference = max(seq_len, s.original_max_position), s.original_max_position
    return _default(dim, theta * ((s.factor * length / reference) - (s.factor - 1)) ** (dim / (dim - 2)))


def model_inv_freqs(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 inverse frequencies of full-attention and of windowed layers, for sequences of up
    to `cfg.max_position` tokens (see the module's docstring)."""
    full = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position)
    return full, (rope_inv_freq(cfg.rope_dim, cfg.rope_local_theta) if cfg.rope_local_theta else full)


def model_attention_factors(cfg: ModelConfig) -> tuple[float, float]:
    """What cos and sin are multiplied by in full-attention and in windowed layers."""
    full = cfg.rope_scaling.attention_factor if cfg.rope_scaling else 1.0
    return full, 1.0 if cfg.rope_local_theta else full


def _kind(params: dict[str, Any], raw: dict[str, Any]) -> str:
    kind = str(params.get("rope_type", params.get("type")) or "default")
    if raw.get("model_type") == "phi3" and kind in ("su", "yarn"):  # as transformers' Phi3Config
        return "longrope"
    return kind


def _scaling(kind: str, p: dict[str, Any], raw: dict[str, Any], rotated_pairs: int) -> RopeScaling:
    """`RopeScaling` of `kind` from its parameters `p`, with the defaults transformers fills in."""
    max_position = int(raw.get("max_position_embeddings", 4096))
    if kind in ("linear", "dynamic"):
        return RopeScaling(kind, float(p["factor"]), max_position)
    # transformers takes a config's top-level original length first (Phi-3's, 4096 by default).
    top = raw.get("original_max_position_embeddings", 4096 if raw.get("model_type") == "phi3" else None)
    original = int(top or p.get("original_max_position_embeddings") or max_position)
    if kind == "llama3":
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        return RopeScaling(kind, float(p["factor"]), original, low_freq_factor=low, high_freq_factor=high)
    factor = float(p.get("factor") or max_position / original)
    given = p.get("attention_factor")
    if kind == "yarn":
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if given is None and mscale and mscale_all_dim:
            given = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        return RopeScaling(
            kind,
            factor,
            original,
            beta_fast=float(p.get("beta_fast") or 32),
            beta_slow=float(p.get("beta_slow") or 1),
            truncate=bool(p.get("truncate", True)),
            attention_factor=float(_yarn_mscale(factor) if given is None else given),
        )
    short, long = tuple(float(f) for f in p["short_factor"]), tuple(float(f) for f in p["long_factor"])
    if len(short) != rotated_pairs or len(long) != rotated_pairs:
        raise ConfigRejected(f"longrope needs {rotated_pairs} short and long factors (one per rotated pair)", "model")
    if given is None:
        given = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(kind, factor, original, short_factor=short, long_factor=long, attention_factor=float(given))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hf_rope_fields(raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """`ModelConfig`'s RoPE fields from a Hugging Face config.json: `rope_theta`, `rope_scaling`,
    `rope_local_theta` (the windowed layers' base where the config names one; 0 = the same RoPE
    as full attention) and `rotary_dim` (from `partial_rotary_factor`, as transformers rounds it).
    transformers >= 5 writes `rope_parameters` (per layer type for Gemma 3); older configs write
    `rope_theta`, `rope_local_base_freq` and `rope_scaling`. A kind not in SUPPORTED, or scaling
    of windowed layers with their own base, is refused naming what the config asked for."""
    rope = raw.get("rope_parameters") or {}
    rope_global = rope.get("full_attention", rope)
    rope_local = rope.get("sliding_attention", {})
    fraction = float(rope_global.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    params = rope_global if _kind(rope_global, raw) != "default" else raw.get("rope_scaling") or {}
    kind = _kind(params, raw)
    if kind not in SUPPORTED:
        raise ConfigRejected(f"RoPE scaling {params} is not supported yet ({', '.join(SUPPORTED)})", "model")
    if _kind(rope_local, raw) != "default":
        raise ConfigRejected(f"RoPE scaling {rope_local} of windowed layers is not supported yet", "model")
    local = rope_local.get("rope_theta", raw.get("rope_local_base_freq", 0.0))
    return {
        "rotary_dim": int(head_dim * fraction) if fraction != 1.0 else 0,
        "rope_theta": float(rope_global.get("rope_theta", raw.get("rope_theta", 10000.0))),
        "rope_scaling": None if kind == "default" else _scaling(kind, params, raw, int(head_dim * fraction) // 2),
        "rope_local_theta": float(local),
    }
