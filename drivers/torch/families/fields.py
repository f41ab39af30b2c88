"""What every family reads the same way from a Hugging Face config.json: shapes, numerics, tokens,
RoPE (`rope.py`) and per-layer windows; and the refusal of biases the shared transformer lacks."""

from __future__ import annotations

from typing import Any

from drivers.errors import ConfigRejected
from drivers.torch.rope import hf_rope_fields


def common_fields(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """`ModelConfig` keyword arguments every family shares."""
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    eos = raw.get("eos_token_id")
    return dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        name=name,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        num_sink_tokens=int(raw.get("num_sink_tokens", 0)),  # wafer extension, absent in HF configs
        **hf_rope_fields(raw, head_dim),
    )


def layer_windows(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0 = full attention) from `layer_types`, Gemma 3's older
    `sliding_window_pattern`, or one window for every layer (Mistral, Phi-3); () = none."""
    window = int(raw.get("sliding_window") or 0)
    types = raw.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    pattern = int(raw.get("sliding_window_pattern") or 0)
    if window and pattern:  # Gemma 3: every pattern-th layer is global
        return tuple(0 if (i + 1) % pattern == 0 else window for i in range(num_layers))
    if window and raw.get("model_type") in ("mistral", "phi3"):
        return (window,) * num_layers
    return ()


def refuse_biases(raw: dict[str, Any], *keys: str) -> None:
    """Refuse a config that sets any of `keys`: biases where the shared transformer has none (the
    output and MLP projections; no released checkpoint of these families has them), or another
    switch it lacks (bidirectional attention)."""
    for key in keys:
        if raw.get(key):
            raise ConfigRejected(f"{raw.get('model_type')} with {key}: true is not supported", "model")
