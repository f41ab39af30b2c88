"""SmolLM3: Llama's block, with some layers attending without RoPE. Its config's `no_rope_layers`
holds one flag per layer, 1 where the layer does use RoPE (by default every 4th layer has none)."""

from __future__ import annotations

from typing import Any

from drivers.torch.config import ModelConfig
from drivers.torch.families.fields import layer_windows, refuse_biases

MODEL_TYPES = ("smollm3",)


def model_config(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    refuse_biases(raw, "attention_bias", "mlp_bias")
    layers = common["num_layers"]
    interval = int(raw.get("no_rope_layer_interval", 4))
    uses_rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    return ModelConfig(
        arch="llama",
        layers_without_rope=tuple(i for i, flag in enumerate(uses_rope) if not flag),
        layer_windows=layer_windows(raw, layers) if raw.get("use_sliding_window") else (),
        **common,
    )
