"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's block whose checkpoint holds q, k and v as one
`qkv_proj` and gate and up as one `gate_up_proj`: split at load into the shared transformer's
names (which the driver fuses again). One window for every layer where `sliding_window` is set.
Phi-3.5 and Phi-4-mini's LongRoPE (and Phi-3's older "su"/"yarn" names for it) and Phi-4-mini's
partial rotation come from `rope.py`."""

from __future__ import annotations

import re
from typing import Any

import torch

from drivers.torch.config import ModelConfig
from drivers.torch.families.fields import layer_windows

MODEL_TYPES = ("phi3",)
_FUSED = re.compile(r"^(model\.layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return ModelConfig(arch="llama", layer_windows=layer_windows(raw, common["num_layers"]), **common)


def adapt_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's fused projections as q/k/v and gate/up (views: no copy)."""
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        m = _FUSED.match(key)
        if m is None:
            out[key] = t
        elif m.group(2) == "self_attn.qkv_proj":
            for name, part in zip(("q_proj", "k_proj", "v_proj"), t.split((q_rows, kv_rows, kv_rows)), strict=True):
                out[f"{m.group(1)}.self_attn.{name}.weight"] = part
        else:
            gate, up = t.split(cfg.intermediate_size)
            out[f"{m.group(1)}.mlp.gate_proj.weight"], out[f"{m.group(1)}.mlp.up_proj.weight"] = gate, up
    return out
