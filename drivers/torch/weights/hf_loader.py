"""Checkpoints from a Hugging Face directory: config.json, *.safetensors, tokenizer.json (and the
chat template from tokenizer_config.json). The config is mapped onto `ModelConfig` by its
family's module (`drivers/torch/families/`); weights keep their Hugging Face names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.families import adapt_weights, hf_config
from drivers.torch.progress import Progress


def load_hf_dir(
    path: Path, show_progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None, str]:
    """Config, state dict (Hugging Face names), tokenizer (if tokenizer.json exists), chat template."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigRejected(f"{config_file} is missing", "model")
    raw = json.loads(config_file.read_text())
    cfg = hf_config(raw, path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigRejected(f"no *.safetensors in {path}", "model")
    state: dict[str, torch.Tensor] = {}
    progress = Progress(f"loading {path.name}", len(files), show_progress)
    for i, f in enumerate(files):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                state[key] = sf.get_tensor(key)
        progress.update(i + 1)
    state = adapt_weights(raw, cfg, state)
    tok_file = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
    template = ""
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.is_file():
        template = str(json.loads(tok_cfg.read_text()).get("chat_template") or "")
    return cfg, state, tokenizer, template
