"""Granite 3: Llama's block with four scalars: embeddings times `embedding_multiplier`, the
softmax scale `attention_multiplier` (not head_dim ** -0.5), attention and MLP outputs times
`residual_multiplier` before their residual adds, logits divided by `logits_scaling`."""

from __future__ import annotations

from typing import Any

from drivers.torch.config import ModelConfig
from drivers.torch.families.fields import refuse_biases

MODEL_TYPES = ("granite",)


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    refuse_biases(raw, "attention_bias", "mlp_bias")
    return ModelConfig(
        arch="llama",
        query_scale=float(raw.get("attention_multiplier", 1.0)),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        **common,
    )
