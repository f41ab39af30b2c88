"""Resolve a model name or path to a loaded checkpoint (config, weights, tokenizer, template):
`smollm2` (the embedded GGUF), a `.gguf` file, or a Hugging Face safetensors directory. A GGUF
file loaded for int8 weights keeps its projections in the file until they are quantized."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.weights.gguf_loader import load_gguf, load_gguf_int8, smollm2_path
from drivers.torch.weights.gguf_stream import Int8Stream
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
    # The projections not in `state`, read from the file as int8 rows when the model is quantized.
    int8: Int8Stream | None = None


def load_checkpoint(name_or_path: str, show_progress: bool = True, int8_dtype: torch.dtype | None = None) -> Checkpoint:
    """`int8_dtype`: the checkpoint is for int8 weights ("int8", "w8a8") with activations in this
    dtype: a GGUF's projections are then streamed into int8 (`load_gguf_int8`), never held in
    float. Other formats load as without it."""
    if name_or_path == "smollm2":
        path, model_name = smollm2_path(), "SmolLM2-135M-Instruct"
    else:
        path, model_name = Path(name_or_path), Path(name_or_path).name
    if path.suffix == ".gguf" and path.is_file():
        int8 = None
        if int8_dtype is None:
            cfg, state, tok = load_gguf(path, show_progress)
        else:
            cfg, state, tok, int8 = load_gguf_int8(path, int8_dtype, show_progress)
        stops = tuple(sorted({tok.eos_token_id, *cfg.eos_token_ids} - {-1}))
        return Checkpoint(cfg, state, model_name, tok.tokenizer, tok.chat_template, stops, tok.control_token_ids, int8)
    if path.is_dir():
        cfg, state, tokenizer, template = load_hf_dir(path, show_progress)
        control: tuple[int, ...] = ()
        if tokenizer is not None:
            decoder = tokenizer.get_added_tokens_decoder()
            control = tuple(sorted(i for i, t in decoder.items() if t.special))
        return Checkpoint(cfg, state, model_name, tokenizer, template, cfg.eos_token_ids, control)
    raise ConfigRejected(f"{name_or_path!r} is not 'smollm2', a .gguf file or a model directory", "model")
