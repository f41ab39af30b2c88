"""Qwen3-MoE: Qwen3's block (per-head q/k norms) whose MLP is a mixture of experts (`moe.py`) in
every `decoder_sparse_step`-th layer not in `mlp_only_layers` (the others keep a dense MLP), the
top-k weights renormalized only where `norm_topk_prob`. Experts saved as fused 3-D tensors
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) are split into one module each."""

from __future__ import annotations

import re
from typing import Any

import torch

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.families.fields import refuse_biases

MODEL_TYPES = ("qwen3_moe",)
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    refuse_biases(raw, "attention_bias")
    layers = common["num_layers"]
    step = int(raw.get("decoder_sparse_step") or 1)
    mlp_only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    window = int(raw.get("sliding_window") or 0) if raw.get("use_sliding_window") else 0
    return ModelConfig(
        arch="llama",
        qk_norm="head",
        layer_windows=(window,) * layers if window else (),
        **moe_fields(
            raw, int(raw.get("num_experts") or raw.get("num_local_experts") or 0), int(raw["moe_intermediate_size"])
        ),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        dense_mlp_layers=tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step),
        **common,
    )


def moe_fields(raw: dict[str, Any], num_experts: int, expert_size: int) -> dict[str, Any]:
    """The experts' shape, after refusing what `moe.py` does not compute (an activation other
    than SiLU, experts shared by every token)."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigRejected(f"{raw.get('model_type')} with hidden_act {raw['hidden_act']!r} is not supported", "model")
    if num_experts <= 0:
        raise ConfigRejected(f"{raw.get('model_type')} with no experts is not supported", "model")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if raw.get(key):
            raise ConfigRejected(f"{raw.get('model_type')} with {key} (shared experts) is not supported", "model")
    return dict(
        num_experts=num_experts,
        experts_per_token=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=expert_size,
    )


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused expert tensors (gate_up_proj [E, 2I, H], gate rows first; down_proj
    [E, H, I]) as one gate/up/down weight per expert (views: no copy); other tensors unchanged."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        m = _FUSED_EXPERTS.match(key)
        if m is None:
            out[key] = t
            continue
        for e, w in enumerate(t.unbind(0)):
            prefix = f"{m.group(1)}.{e}"
            if m.group(2) == "down_proj":
                out[f"{prefix}.down_proj.weight"] = w
            else:
                out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = w.chunk(2)
    return out


def adapt_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return split_fused_experts(state)
