"""OLMo 2: no norms before attention and MLP; their outputs are normed before the residual adds
(`post_attention_layernorm`, `post_feedforward_layernorm`), and q and k are normed over the whole
projection (all heads at once) before RoPE. Its RMS norm multiplies by the weight in float32."""

from __future__ import annotations

from typing import Any

from drivers.torch.config import ModelConfig
from drivers.torch.families.fields import refuse_biases

MODEL_TYPES = ("olmo2",)


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    refuse_biases(raw, "attention_bias")
    return ModelConfig(
        arch="llama",
        qk_norm="projection",
        has_pre_norms=False,
        norm_weight_in_float32=True,
        **common,
    )
