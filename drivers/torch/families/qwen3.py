"""Qwen3: Qwen2's block without q/k/v biases, with an RMS norm over each head of q and k before
RoPE (weights of head_dim, shared by the heads)."""

from __future__ import annotations

from typing import Any

from drivers.torch.config import ModelConfig
from drivers.torch.families.fields import layer_windows, refuse_biases

MODEL_TYPES = ("qwen3",)


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    refuse_biases(raw, "attention_bias")  # Qwen3's would include the output projection's
    windowed = raw.get("use_sliding_window", False)
    return ModelConfig(
        arch="llama",
        qk_norm="head",
        layer_windows=layer_windows(raw, common["num_layers"]) if windowed else (),
        **common,
    )
