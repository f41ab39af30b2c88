"""Mixtral: Mistral's block whose MLP is a mixture of experts (`moe.py`) in every layer, each
expert of `intermediate_size`, the top-k weights always renormalized; one window for every layer
where `sliding_window` is set (null: full attention). Its checkpoints name the block
`block_sparse_moe` and an expert's gate, down and up `w1`, `w2`, `w3`: renamed at load."""

from __future__ import annotations

import re
from typing import Any

import torch

from drivers.torch.config import ModelConfig
from drivers.torch.families.qwen3_moe import moe_fields, split_fused_experts

MODEL_TYPES = ("mixtral",)
_RENAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate|experts\.\d+\.(w[123]))\.weight$")


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    window = int(raw.get("sliding_window") or 0)
    return ModelConfig(
        arch="llama",
        layer_windows=(window,) * common["num_layers"] if window else (),
        **moe_fields(raw, int(raw["num_local_experts"]), common["intermediate_size"]),
        norm_topk_prob=True,
        **common,
    )


def adapt_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`block_sparse_moe.*` and `w1/w2/w3` under the shared names; fused experts split."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        m = _EXPERT.match(key)
        if m is None:
            out[key] = t
        elif m.group(3) is None:
            out[f"{m.group(1)}.mlp.gate.weight"] = t
        else:
            expert = m.group(2).rsplit(".", 1)[0]
            out[f"{m.group(1)}.mlp.{expert}.{_RENAMES[m.group(3)]}.weight"] = t
    return split_fused_experts(out)
