"""The model families a Hugging Face checkpoint may be, one module each: its config.json mapped
onto `ModelConfig`'s switches and, where its tensors are laid out otherwise, adapted to the shared
transformer's names. The table below picks the module by `model_type`."""

from __future__ import annotations

from typing import Any

import torch

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.families import gemma, granite, llama, mixtral, olmo2, phi3, qwen3, qwen3_moe, smollm3
from drivers.torch.families.fields import common_fields

_MODULES = (llama, qwen3, olmo2, granite, smollm3, phi3, gemma, mixtral, qwen3_moe)
_BY_TYPE = {kind: module for module in _MODULES for kind in module.MODEL_TYPES}
MODEL_TYPES = tuple(_BY_TYPE)


def hf_config(raw: dict[str, Any], name: str) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config.json (its parsed dict); `name` names the model."""
    kind = raw.get("model_type")
    module = _BY_TYPE.get(str(kind))
    if module is None:
        raise ConfigRejected(f"model_type {kind!r} is not supported ({', '.join(MODEL_TYPES)})", "model")
    return module.model_config(raw, common_fields(raw, name))


def adapt_weights(raw: dict[str, Any], cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the shared transformer's names (Phi-3 splits its fused ones,
    Mixtral renames its experts' and the MoE families split fused experts)."""
    module = _BY_TYPE.get(str(raw.get("model_type")))
    adapt = getattr(module, "adapt_weights", None)
    return state if adapt is None else adapt(cfg, state)
