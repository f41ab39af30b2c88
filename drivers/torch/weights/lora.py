"""LoRA adapters in PEFT's safetensors format, and the per-pass delta that applies several of
them in one batch (each request its own adapter, -1 = base model). Knows PEFT's file layout and
key names; the model only sees the `LoraDelta` callable."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from safetensors.torch import load_file

from drivers.errors import RequestRejected

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(slots=True)
class LoraWeights:
    scale: float
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, proj) -> (A [r, in], B [out, r])


def load_peft(path: Path, num_layers: int, dtype: torch.dtype, device: torch.device) -> LoraWeights:
    cfg_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights_file.is_file():
        raise RequestRejected(f"{path} needs adapter_config.json and adapter_model.safetensors", "path")
    cfg = json.loads(cfg_file.read_text())
    rank = int(cfg.get("r", 8))
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / (rank**0.5 if cfg.get("use_rslora") else rank)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, w in load_file(str(weights_file)).items():
        m = _KEY.search(key)
        if m is None:
            raise RequestRejected(f"unsupported LoRA tensor {key}", "path")
        layer = int(m.group(1))
        if layer >= num_layers:
            raise RequestRejected(f"LoRA tensor {key} names layer {layer} of {num_layers}", "path")
        found.setdefault((layer, m.group(2)), {})[m.group(3)] = w.to(device=device, dtype=dtype)
    pairs = {}
    for where, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise RequestRejected(f"LoRA pair {where} lacks its A or B matrix", "path")
        pairs[where] = (ab["A"], ab["B"])
    return LoraWeights(scale, pairs)


class LoraBatch:
    """The `LoraDelta` of one pass: rows of token i use the adapter of its request."""

    def __init__(
        self, adapters: dict[int, LoraWeights], token_adapter: npt.NDArray[np.int64], device: torch.device
    ) -> None:
        self.groups = [
            (adapters[a], torch.as_tensor(np.nonzero(token_adapter == a)[0], device=device))
            for a in np.unique(token_adapter).tolist()
            if a >= 0
        ]

    def __call__(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        delta: torch.Tensor | None = None
        for weights, rows in self.groups:
            pair = weights.pairs.get((layer, name))
            if pair is None:
                continue
            a, b = pair
            part = (x[rows] @ a.T) @ b.T * weights.scale
            if delta is None:
                delta = torch.zeros(x.shape[0], b.shape[0], dtype=x.dtype, device=x.device)
            delta.index_add_(0, rows, part.to(x.dtype))
        return delta
