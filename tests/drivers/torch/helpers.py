"""Shared test helpers: build `Forward`s for a prompt in chunks over pages, tiny random
checkpoints written to safetensors, and transformers twins of our models."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch.utils import cpp_extension

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward
from bridge_schema.messages import Forward, Hello
from drivers.torch.config import ModelConfig
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.kernels import cpu_kernels
from drivers.torch.weights.checkpoint import Checkpoint, load_checkpoint

GREEDY = Sampler()

cpu_kernels.ninja_on_path()  # as the build does: the `ninja` package's binary where PATH has none
CAN_BUILD = cpp_extension.is_ninja_available() and shutil.which("c++") is not None
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no C++ toolchain (ninja and c++) to build the kernel")
# What each instruction-set level needs beyond the one below it, for the skip reason (`isa`, conftest.py).
FEATURES = {
    "avx2": "AVX2, FMA and F16C",
    "avx2_vnni": "AVX-VNNI",
    "avx512": "AVX-512 F/DQ/BW/VL",
    "avx512_vnni": "AVX512-VNNI",
}


def make_driver(ckpt: Checkpoint, page_size: int = 16, num_pages: int = 64) -> TorchDriver:
    drv = TorchDriver(ckpt, DriverOptions(page_size=page_size, num_pages=num_pages))
    drv.handshake(Hello())
    return drv


def request(
    tokens: Sequence[int],
    start: int,
    pages: Sequence[int],
    page_size: int,
    *,
    all_rows: bool = False,
    sampler: Sampler = GREEDY,
    context_id: int = 0,
    mask_rows: Sequence[Sequence[int]] | None = None,
    adapter_id: int = -1,
    outputs: Sequence[OutputSpec] | None = None,
) -> RequestSpec:
    """`tokens` at positions start.. filling slots start.. of a context that owns `pages`."""
    kv_len = start + len(tokens)
    num_pages = (kv_len + page_size - 1) // page_size
    if outputs is None:
        rows = range(len(tokens)) if all_rows else [len(tokens) - 1]
        outputs = [OutputSpec(row=r, sampler=sampler) for r in rows]
    return RequestSpec(
        context_id=context_id,
        tokens=list(tokens),
        positions=list(range(start, kv_len)),
        pages=list(pages[:num_pages]),
        last_page_len=kv_len - (num_pages - 1) * page_size,
        outputs=list(outputs),
        adapter_id=adapter_id,
        mask_rows=mask_rows,
    )


def forward(specs: Sequence[RequestSpec], rid: int = 1) -> Forward:
    return build_forward(rid, list(specs))


def chunked_logits(
    drv: TorchDriver,
    tokens: Sequence[int],
    chunk: int,
    pages: Sequence[int],
    mask_rows: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Logits of every prompt row, computed in chunks of `chunk` tokens. `mask_rows` are the
    full-prompt rows (over all keys); each chunk sends them cut to its own kv_len."""
    ps = drv.limits.page_size if drv.limits else 16
    out = []
    for s in range(0, len(tokens), chunk):
        part = tokens[s : s + chunk]
        rows = None
        if mask_rows is not None:
            rows = [cut_brle(mask_rows[s + i], s + len(part)) for i in range(len(part))]
        out.append(drv.logits(forward([request(part, s, pages, ps, all_rows=True, mask_rows=rows)])))
    return torch.cat(out)


def brle(bits: Sequence[bool]) -> list[int]:
    """BRLE run lengths (false run first) of a boolean row."""
    runs, current, n = [], False, 0
    for b in bits:
        if bool(b) == current:
            n += 1
        else:
            runs.append(n)
            current, n = not current, 1
    runs.append(n)
    return runs


def unbrle(runs: Sequence[int]) -> list[bool]:
    return [bool(i % 2) for i, r in enumerate(runs) for _ in range(r)]


def cut_brle(runs: Sequence[int], length: int) -> list[int]:
    return brle(unbrle(runs)[:length])


# ---------------------------------------------------------------- tiny checkpoints


# A tiny shape every family takes, with the token ids inside its vocabulary.
TINY_SHAPE: dict[str, object] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def write_tiny_family(path: Path, model_type: str, seed: int = 0, **overrides: object) -> Path:
    """A random-weight model of any family transformers knows (`model_type`, e.g. "qwen3"), in
    `TINY_SHAPE` with `overrides`, saved by transformers as safetensors with config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**TINY_SHAPE, **overrides})
    model = AutoModelForCausalLM.from_config(cfg)
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_tiny_llama(path: Path, seed: int = 0, **overrides: object) -> Path:
    """A random-weight Llama (GQA) saved by transformers as safetensors, with config.json."""
    tiny: dict[str, object] = dict(vocab_size=96, num_hidden_layers=2, rope_theta=10000.0, pad_token_id=None)
    return write_tiny_family(path, "llama", seed, **{**tiny, **overrides})


def write_tiny_gemma(path: Path, sliding_window: int, seed: int = 0, num_sink_tokens: int = 0) -> Path:
    """A random-weight Gemma-3-style model: layers alternate sliding-window and full attention."""
    write_tiny_family(
        path,
        "gemma3_text",
        seed,
        vocab_size=96,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=16,
        rope_theta=10000.0,
        rope_local_base_freq=1000.0,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    if num_sink_tokens:
        raw = json.loads((path / "config.json").read_text())
        raw["num_sink_tokens"] = num_sink_tokens
        (path / "config.json").write_text(json.dumps(raw))
    return path


def _randomize(model: torch.nn.Module) -> None:
    # Default inits leave norms at 1 (or 0 for Gemma) and small weights; random norms and larger
    # weights make attention patterns sharp enough that a wrong mask shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "Gemma" in type(model).__name__ else 1.0))
            else:
                p.copy_(torch.randn_like(p) * 0.15)


LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def write_adapter(
    path: Path, ckpt: Checkpoint, seed: int, rank: int = 4, alpha: float = 8.0
) -> dict[str, torch.Tensor]:
    """Writes a PEFT adapter; returns the merged deltas (scale * B @ A) by weight name."""
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for layer in range(ckpt.cfg.num_layers):
        for proj in LORA_TARGETS:
            part = "mlp" if proj == "down_proj" else "self_attn"
            name = f"model.layers.{layer}.{part}.{proj}.weight"
            out_dim, in_dim = ckpt.state[name].shape
            a = torch.randn(rank, in_dim, generator=g) * 0.2
            b = torch.randn(out_dim, rank, generator=g) * 0.2
            prefix = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            deltas[name] = (alpha / rank) * b @ a
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": LORA_TARGETS}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return deltas


def load_dir(path: Path) -> Checkpoint:
    return load_checkpoint(str(path), show_progress=False)


def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def llama_twin(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' LlamaForCausalLM carrying our (dequantized) weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    model = LlamaForCausalLM(hc).eval()
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    model.tie_weights()
    return model
