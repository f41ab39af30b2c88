"""Resolve a model name or path to a loaded checkpoint (config, weights, tokenizer, template):
`smollm2` (the embedded GGUF), a `.gguf` file, or a Hugging Face safetensors directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.weights.gguf_loader import load_gguf, smollm2_path
from drivers.torch.weights.hf_loader import load_hf_dir


@dataclass(slots=True)
class Checkpoint:
    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    model_name: str
    tokenizer: Tokenizer | None
    chat_template: str
    stop_token_ids: tuple[int, ...]
    control_token_ids: tuple[int, ...]


def load_checkpoint(name_or_path: str, show_progress: bool = True) -> Checkpoint:
    if name_or_path == "smollm2":
        path, model_name = smollm2_path(), "SmolLM2-135M-Instruct"
    else:
        path, model_name = Path(name_or_path), Path(name_or_path).name
    if path.suffix == ".gguf" and path.is_file():
        cfg, state, tok = load_gguf(path, show_progress)
        stops = tuple(sorted({tok.eos_token_id, *cfg.eos_token_ids} - {-1}))
        return Checkpoint(cfg, state, model_name, tok.tokenizer, tok.chat_template, stops, tok.control_token_ids)
    if path.is_dir():
        cfg, state, tokenizer, template = load_hf_dir(path, show_progress)
        control: tuple[int, ...] = ()
        if tokenizer is not None:
            decoder = tokenizer.get_added_tokens_decoder()
            control = tuple(sorted(i for i, t in decoder.items() if t.special))
        return Checkpoint(cfg, state, model_name, tokenizer, template, cfg.eos_token_ids, control)
    raise ConfigRejected(f"{name_or_path!r} is not 'smollm2', a .gguf file or a model directory", "model")
