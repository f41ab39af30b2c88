"""The GGUF architectures the torch driver runs, one table row each: the file's metadata mapped onto
`ModelConfig` (`gguf_config`), its tensor names mapped to the Hugging Face names the model file
expects (`hf_name`), and llama.cpp's converter choices undone (`to_hf_layout`, `split_fused`): q/k
rows permuted for interleaved RoPE, Gemma norms stored as 1 + w, Phi-3's fused projections.
It reads names and metadata through `gguf.constants`; it knows nothing of quantized blocks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

from drivers.errors import ConfigRejected
from drivers.torch.config import ModelConfig
from drivers.torch.families import phi3
from drivers.torch.rope import RopeScaling, rope_inv_freq
from drivers.torch.weights.gguf_tokenizer import GGUFTokenizer

T = MODEL_TENSOR
# Per-layer GGUF tensors -> Hugging Face module names, as llama.cpp's converter maps them.
_LAYER = {
    T.ATTN_NORM: "input_layernorm",
    T.FFN_NORM: "post_attention_layernorm",
    T.ATTN_Q: "self_attn.q_proj",
    T.ATTN_K: "self_attn.k_proj",
    T.ATTN_V: "self_attn.v_proj",
    T.ATTN_QKV: "self_attn.qkv_proj",
    T.ATTN_OUT: "self_attn.o_proj",
    T.ATTN_Q_NORM: "self_attn.q_norm",
    T.ATTN_K_NORM: "self_attn.k_norm",
    T.ATTN_POST_NORM: "post_attention_layernorm",
    T.FFN_POST_NORM: "post_feedforward_layernorm",
    T.FFN_GATE: "mlp.gate_proj",
    T.FFN_UP: "mlp.up_proj",
    T.FFN_DOWN: "mlp.down_proj",
}
# Gemma's ffn_norm (gguf's FFN_PRE_NORM, same name) is the norm before the MLP; Llama's is HF's
# post_attention_layernorm.
_GEMMA_LAYER = {**_LAYER, T.FFN_PRE_NORM: "pre_feedforward_layernorm"}
# Phi-3's ffn_up holds gate and up stacked (HF's gate_up_proj).
_PHI3_LAYER = {**_LAYER, T.FFN_UP: "mlp.gate_up_proj"}
_GLOBAL = {T.TOKEN_EMBD: "model.embed_tokens", T.OUTPUT_NORM: "model.norm", T.OUTPUT: "lm_head"}


@dataclass(frozen=True, slots=True)
class Arch:
    """How llama.cpp writes one architecture. `permuted`: q/k rows in interleaved-RoPE order
    (LlamaModel.permute); `norm_shift`: what the converter added to every norm weight."""

    arch: MODEL_ARCH
    layer_names: dict[MODEL_TENSOR, str]
    permuted: bool = False
    norm_shift: float = 0.0


_ARCHS = {
    MODEL_ARCH_NAMES[a.arch]: a
    for a in (
        Arch(MODEL_ARCH.LLAMA, _LAYER, permuted=True),  # Llama 2/3, Mistral
        Arch(MODEL_ARCH.QWEN2, _LAYER),
        Arch(MODEL_ARCH.QWEN3, _LAYER),
        Arch(MODEL_ARCH.GEMMA2, _GEMMA_LAYER, norm_shift=1.0),
        Arch(MODEL_ARCH.GEMMA3, _GEMMA_LAYER, norm_shift=1.0),
        Arch(MODEL_ARCH.PHI3, _PHI3_LAYER),
        Arch(MODEL_ARCH.OLMO2, _LAYER),
        Arch(MODEL_ARCH.GRANITE, _LAYER, permuted=True),
        Arch(MODEL_ARCH.SMOLLM3, _LAYER, permuted=True),
    )
}
SUPPORTED = tuple(_ARCHS)
# llama.cpp scales Gemma's queries by (hidden / heads) ** -0.5 for the 27B models, which it knows
# by their layer count (the file has no query_pre_attn_scalar); the others by head_dim ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's default sliding-window patterns (every n-th layer global) where the file has none.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp hard-codes it: the file does not say
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


def architecture(reader: gguf.GGUFReader) -> str:
    """The file's `general.architecture`, refused unless the driver runs it."""
    name = str(_meta(reader, gguf.Keys.General.ARCHITECTURE))
    if name not in _ARCHS:
        raise ConfigRejected(f"GGUF architecture {name!r} is not supported ({', '.join(SUPPORTED)})", "model")
    return name


def _meta(reader: gguf.GGUFReader, key: str, default: object = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-RoPE row order so rotate-half RoPE applies."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: gguf.GGUFReader, tok: GGUFTokenizer, name: str) -> ModelConfig:
    """The `ModelConfig` of a GGUF file of a supported architecture."""
    arch = architecture(reader)

    def key(k: str, default: object = None) -> Any:
        return _meta(reader, k.format(arch=arch), default)

    heads = int(key(gguf.Keys.Attention.HEAD_COUNT))
    hidden = int(key(gguf.Keys.LLM.EMBEDDING_LENGTH))
    layers = int(key(gguf.Keys.LLM.BLOCK_COUNT))
    head_dim = int(key(gguf.Keys.Attention.KEY_LENGTH, hidden // heads))
    rope_dim = int(key(gguf.Keys.Rope.DIMENSION_COUNT, head_dim))
    theta = float(key(gguf.Keys.Rope.FREQ_BASE, 10000.0))
    names = {t.name for t in reader.tensors}
    eot = _meta(reader, gguf.Keys.Tokenizer.EOT_ID)
    fields: dict[str, Any] = dict(
        vocab_size=int(key(gguf.Keys.LLM.VOCAB_SIZE, len(tok.tokenizer.get_vocab()))),
        hidden_size=hidden,
        intermediate_size=int(key(gguf.Keys.LLM.FEED_FORWARD_LENGTH)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key(gguf.Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim,
        rotary_dim=rope_dim if rope_dim != head_dim else 0,
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, rope_dim, theta),
        rms_eps=float(key(gguf.Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        max_position=int(key(gguf.Keys.LLM.CONTEXT_LENGTH, 4096)),
        tie_embeddings=TENSOR_NAMES[T.OUTPUT] + ".weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        name=name,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tuple(sorted({tok.eos_token_id, int(eot) if eot is not None else -1} - {-1})),
    )
    window = int(key(gguf.Keys.Attention.SLIDING_WINDOW, 0))
    if window:
        fields["layer_windows"] = _windows(key(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN), arch, window, layers)
    if arch in ("gemma2", "gemma3"):
        big = layers == _GEMMA_27B_LAYERS[arch]
        return ModelConfig(
            arch="gemma",
            query_scale=(hidden // heads if big else head_dim) ** -0.5,
            qk_norm="head" if arch == "gemma3" else "",
            attn_logit_softcap=float(key(gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING, 0.0)),
            final_logit_softcap=float(key(gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 0.0)),
            rope_local_theta=float(key(gguf.Keys.Rope.FREQ_BASE_SWA, 10000.0 if arch == "gemma3" else 0.0)),
            **fields,
        )
    if arch == "qwen3":
        fields["qk_norm"] = "head"
    elif arch == "olmo2":
        fields.update(qk_norm="projection", has_pre_norms=False, norm_weight_in_float32=True)
    elif arch == "granite":
        fields.update(
            query_scale=float(key(gguf.Keys.Attention.SCALE, 0.0)),
            embedding_multiplier=float(key(gguf.Keys.LLM.EMBEDDING_SCALE, 1.0)),
            residual_multiplier=float(key(gguf.Keys.LLM.RESIDUAL_SCALE, 1.0)),
            logits_scaling=float(key(gguf.Keys.LLM.LOGIT_SCALE, 1.0)),
        )
    elif arch == "smollm3":
        fields["layers_without_rope"] = tuple(i for i in range(layers) if (i + 1) % _SMOLLM3_NO_ROPE_STEP == 0)
    return ModelConfig(arch="llama", **fields)


def _windows(pattern: Any, arch: str, window: int, layers: int) -> tuple[int, ...]:
    """Each layer's window: the file's per-layer flags, its every-n-th-layer-global count, the
    architecture's llama.cpp default, or every layer windowed (Phi-3, OLMo 3)."""
    if isinstance(pattern, list):
        return tuple(window if sliding else 0 for sliding in pattern)
    every = int(pattern) if pattern is not None else _SWA_PATTERN.get(arch, 0)
    return tuple(0 if every and (i + 1) % every == 0 else window for i in range(layers))


def _rope_scaling(reader: gguf.GGUFReader, arch: str, rope_dim: int, theta: float) -> RopeScaling | None:
    """RoPE scaling from the file: "linear" from its metadata (Gemma 3), Llama 3.1+'s from the
    `rope_freqs` tensor llama.cpp writes instead of its factors; others are refused."""
    kind = str(_meta(reader, gguf.Keys.Rope.SCALING_TYPE.format(arch=arch), "none"))
    names = {t.name for t in reader.tensors}
    if names & {TENSOR_NAMES[T.ROPE_FACTORS_LONG] + ".weight", TENSOR_NAMES[T.ROPE_FACTORS_SHORT] + ".weight"}:
        kind = "longrope"
    if kind == "linear":
        factor = float(_meta(reader, gguf.Keys.Rope.SCALING_FACTOR.format(arch=arch), 1.0))
        return RopeScaling("linear", factor, 0)
    if kind != "none":
        raise ConfigRejected(f"GGUF RoPE scaling {kind!r} is not supported (none, linear, llama3 rope_freqs)", "model")
    freqs = next((t for t in reader.tensors if t.name == TENSOR_NAMES[T.ROPE_FREQS] + ".weight"), None)
    return None if freqs is None else _llama3_rope(reader, arch, freqs, rope_dim, theta)


def _llama3_rope(
    reader: gguf.GGUFReader, arch: str, freqs: gguf.ReaderTensor, rope_dim: int, theta: float
) -> RopeScaling:
    """Llama 3.1+ scaling from `rope_freqs` (per-frequency divisors): the parameters Meta released
    (low 1, high 4, original context 8192 unless the file says) with the largest divisor as
    factor, accepted only if they give the tensor back."""
    divisors = torch.from_numpy(np.array(freqs.data, dtype=np.float32)).reshape(-1)
    original = int(_meta(reader, gguf.Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch), 8192))
    scaling = RopeScaling("llama3", float(divisors.max()), original, low_freq_factor=1.0, high_freq_factor=4.0)
    plain = rope_inv_freq(rope_dim, theta)
    if divisors.shape != plain.shape or not torch.allclose(plain / rope_inv_freq(rope_dim, theta, scaling), divisors):
        raise ConfigRejected(
            f"GGUF rope_freqs are not Llama 3's RoPE scaling (factor {scaling.factor:g}, low 1, high 4, "
            f"original context {original}), the only rope_freqs supported",
            "model",
        )
    return scaling


def hf_name(arch: str, name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name`; None for a tensor the config already holds
    (`rope_freqs`). An unknown tensor is refused naming the ones the architecture may have."""
    spec = _ARCHS[arch]
    allowed = MODEL_TENSORS[spec.arch]
    if name == TENSOR_NAMES[T.ROPE_FREQS] + ".weight" and T.ROPE_FREQS in allowed:
        return None
    for kind, hf in _GLOBAL.items():
        if name == TENSOR_NAMES[kind] + ".weight" and kind in allowed:
            return hf + ".weight"
    m = _BLOCK.match(name)
    if m is not None:
        for kind, hf in spec.layer_names.items():
            if TENSOR_NAMES[kind] == "blk.{bid}." + m.group(2) and kind in allowed:
                return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    known = [TENSOR_NAMES[k] for k in (*_GLOBAL, *spec.layer_names) if k in allowed]
    raise ConfigRejected(f"GGUF tensor {name} is not supported for {arch} ({', '.join(known)})", "model")


def to_hf_layout(arch: str, cfg: ModelConfig, key: str, w: torch.Tensor) -> torch.Tensor:
    """Float tensor `w` (Hugging Face name `key`) as the model file expects it: q/k rows back in
    rotate-half order where llama.cpp permuted them, Gemma's norms back to w (from 1 + w)."""
    spec = _ARCHS[arch]
    if spec.permuted and key.endswith("q_proj.weight"):
        return unpermute_rope_rows(w, cfg.num_heads)
    if spec.permuted and key.endswith("k_proj.weight"):
        return unpermute_rope_rows(w, cfg.num_kv_heads)
    if spec.norm_shift and key.endswith("norm.weight"):
        return w - spec.norm_shift
    return w


def split_fused(arch: str, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with Phi-3's fused qkv and gate_up split into the shared transformer's names."""
    return phi3.adapt_weights(cfg, state) if arch == MODEL_ARCH_NAMES[MODEL_ARCH.PHI3] else state
