"""Checkpoints from a Hugging Face directory: config.json, *.safetensors, tokenizer.json (and the
chat template from tokenizer_config.json). Maps Llama, Qwen2 and Gemma-3-text configs onto
`ModelConfig`; weights keep their Hugging Face names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.progress import Progress


def _windows(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    window = int(raw.get("sliding_window") or 0)
    types = raw.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    pattern = int(raw.get("sliding_window_pattern") or 0)
    if window and pattern:  # Gemma 3: every pattern-th layer is global
        return tuple(0 if (i + 1) % pattern == 0 else window for i in range(num_layers))
    if window and raw.get("model_type") == "mistral":  # Mistral: every layer is windowed
        return (window,) * num_layers
    return ()


def hf_config(raw: dict[str, Any], name: str) -> ModelConfig:
    kind = raw.get("model_type")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    layers = int(raw["num_hidden_layers"])
    # transformers >= 5 writes `rope_parameters` (per layer type for Gemma 3); older configs
    # write `rope_theta`, `rope_local_base_freq` and `rope_scaling`.
    rope = raw.get("rope_parameters") or {}
    rope_global = rope.get("full_attention", rope)
    rope_local = rope.get("sliding_attention", {})
    llama3 = None
    for params in (rope_global, rope_local, raw.get("rope_scaling") or {}):
        kind_ = params.get("rope_type", params.get("type"))
        if kind_ == "llama3":
            llama3 = (
                float(params["factor"]),
                float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                int(params["original_max_position_embeddings"]),
            )
        elif kind_ not in (None, "default"):
            raise ConfigRejected(f"RoPE scaling {params} is not supported yet (default, llama3)", "model")
    rope_theta = float(rope_global.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_local_theta = float(rope_local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))
    eos = raw.get("eos_token_id")
    common: dict[str, Any] = dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=rope_theta,
        rope_llama3=llama3,
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        name=name,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        num_sink_tokens=int(raw.get("num_sink_tokens", 0)),  # wafer extension, absent in HF configs
    )
    if kind in ("llama", "mistral", "qwen2"):
        return ModelConfig(
            arch="llama",
            attention_bias=bool(raw.get("attention_bias", kind == "qwen2")),
            layer_windows=_windows(raw, layers) if raw.get("use_sliding_window", kind != "qwen2") else (),
            **common,
        )
    if kind in ("gemma3_text", "gemma3"):
        if raw.get("attn_logit_softcapping"):
            raise ConfigRejected("attention logit softcapping is not supported", "model")
        return ModelConfig(
            arch="gemma",
            layer_windows=_windows(raw, layers),
            rope_local_theta=rope_local_theta,
            query_scale=float(raw.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
            qk_norm=True,
            final_logit_softcap=float(raw.get("final_logit_softcapping") or 0.0),
            **common,
        )
    raise ConfigRejected(f"model_type {kind!r} is not supported (llama, mistral, qwen2, gemma3_text)", "model")


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
    tok_file = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
    template = ""
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.is_file():
        template = str(json.loads(tok_cfg.read_text()).get("chat_template") or "")
    return cfg, state, tokenizer, template
