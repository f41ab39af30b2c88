"""Llama 2/3, Mistral and Qwen2: the shared transformer as it is. Qwen2 adds biases to q, k and v
and windows only with `use_sliding_window`; Mistral windows every layer."""

from __future__ import annotations

from typing import Any

from drivers.torch.config import ModelConfig
from drivers.torch.families.fields import layer_windows

MODEL_TYPES = ("llama", "mistral", "qwen2")


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    kind = raw.get("model_type")
    windowed = raw.get("use_sliding_window", kind != "qwen2")
    return ModelConfig(
        arch="llama",
        attention_bias=bool(raw.get("attention_bias", kind == "qwen2")),
        layer_windows=layer_windows(raw, common["num_layers"]) if windowed else (),
        **common,
    )
