"""Gemma 2 and Gemma 3 (text): the "gemma" block ((1 + w) norms around attention and MLP,
GELU-tanh, embeddings times sqrt(hidden)), the softmax scale from `query_pre_attn_scalar`,
alternating windowed layers and a final logit soft cap. Gemma 2 caps attention scores too and
has one RoPE base; Gemma 3 norms each head of q and k and gives windowed layers their own base."""

from __future__ import annotations

from typing import Any

from drivers.torch.config import ModelConfig
from drivers.torch.families.fields import layer_windows, refuse_biases

MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    refuse_biases(raw, "attention_bias", "use_bidirectional_attention")
    gemma3 = raw.get("model_type") != "gemma2"
    if gemma3:  # Gemma 3's windowed layers default to base 10,000, whatever the global base
        common = {**common, "rope_local_theta": common["rope_local_theta"] or 10000.0}
    else:
        common = {**common, "rope_local_theta": 0.0}
    return ModelConfig(
        arch="gemma",
        layer_windows=layer_windows(raw, common["num_layers"]),
        query_scale=float(raw.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        qk_norm="head" if gemma3 else "",
        attn_logit_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
        final_logit_softcap=float(raw.get("final_logit_softcapping") or 0.0),
        **common,
    )
