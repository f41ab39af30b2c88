"""GGUF files of each architecture `drivers/torch/weights/gguf_arch.py` maps, written from a tiny
random transformers checkpoint the way llama.cpp's convert_hf_to_gguf.py writes them (tensor
names from gguf's TensorNameMap, q/k rows permuted for Llama, Granite and SmolLM3, Gemma norms
stored as 1 + w, Phi-3's fused projections, Llama 3.1's rope_freqs, metadata under gguf.Keys), in
float32: the driver's logits within 1e-4 of transformers' over a prefill and decode steps, and
files it cannot run refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES

from drivers.errors import ConfigRejected
from tests.drivers.torch.helpers import (
    forward,
    hf_model,
    load_dir,
    make_driver,
    random_tokens,
    request,
    write_tiny_family,
)

# Per case: (model_type, GGUF architecture, settings of the tiny checkpoint that make the
# architecture's difference show). Only what llama.cpp's files can say: Gemma's query scale is
# head_dim ** -0.5 (no query_pre_attn_scalar in the file), SmolLM3 drops RoPE on every 4th layer.
CASES: dict[str, tuple[str, MODEL_ARCH, dict[str, object]]] = {
    "llama": ("llama", MODEL_ARCH.LLAMA, {}),
    "llama3.1": (
        "llama",
        MODEL_ARCH.LLAMA,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        ),
    ),
    "mistral": ("mistral", MODEL_ARCH.LLAMA, dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", MODEL_ARCH.QWEN2, {}),
    "qwen3": ("qwen3", MODEL_ARCH.QWEN3, {}),
    "olmo2": ("olmo2", MODEL_ARCH.OLMO2, {}),
    "granite": (
        "granite",
        MODEL_ARCH.GRANITE,
        dict(embedding_multiplier=3.0, attention_multiplier=0.1, residual_multiplier=0.4, logits_scaling=2.5),
    ),
    "smollm3": ("smollm3", MODEL_ARCH.SMOLLM3, {}),
    "phi3": (
        "phi3",
        MODEL_ARCH.PHI3,
        dict(sliding_window=8, partial_rotary_factor=0.5, original_max_position_embeddings=256),
    ),
    "gemma2": (
        "gemma2",
        MODEL_ARCH.GEMMA2,
        dict(
            tie_word_embeddings=True,
            sliding_window=4,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,  # RoPE base 10,000: llama.cpp's Gemma 2 files do not say
        ),
    ),
    "gemma3": (
        "gemma3_text",
        MODEL_ARCH.GEMMA3,
        dict(
            tie_word_embeddings=True,
            num_hidden_layers=6,  # llama.cpp's pattern: every 6th layer global
            sliding_window=4,
            query_pre_attn_scalar=16,
            final_logit_softcapping=5.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
}
PAGE_SIZE = 4
PAGES = list(range(32))[::-1]
PROMPT, STEPS = 13, 6


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: rotate-half rows to interleaved-RoPE order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_vocab(w: gguf.GGUFWriter, vocab_size: int, bos: int, eos: int) -> None:
    """A byte-level BPE vocabulary: three control tokens, single bytes, and "Ġt" from one merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    tokens = [f"<c{i}>" for i in range(3)] + [chars[b] for b in range(3, vocab_size - 1)] + ["Ġt"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i < 3 else 1 for i in range(vocab_size)])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)


def _llama3_rope_freqs(rope: dict[str, Any], dim: int) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: one divisor per rotated pair of dims."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], 8192
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def convert(hf_dir: Path, arch: MODEL_ARCH, out: Path) -> Path:
    """`hf_dir` as llama.cpp's converter writes it, in float32."""
    from safetensors.torch import load_file

    raw = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    name = MODEL_ARCH_NAMES[arch]
    layers, heads, kv = raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    rope = raw.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(out), name)
    w.add_name(hf_dir.name)
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(raw["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(raw["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    if arch not in (MODEL_ARCH.GRANITE, MODEL_ARCH.PHI3):  # their converters override the base's
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch != MODEL_ARCH.GEMMA2:
        w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))
    if arch in (MODEL_ARCH.LLAMA, MODEL_ARCH.GRANITE, MODEL_ARCH.SMOLLM3):
        w.add_vocab_size(raw["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == MODEL_ARCH.GRANITE:
        w.add_attention_scale(raw["attention_multiplier"])
        w.add_embedding_scale(raw["embedding_multiplier"])
        w.add_residual_scale(raw["residual_multiplier"])
        w.add_logit_scale(raw["logits_scaling"])
    if arch == MODEL_ARCH.PHI3:
        w.add_rope_dimension_count(int(raw["partial_rotary_factor"] * raw["hidden_size"]) // heads)
        w.add_sliding_window(raw.get("sliding_window") or 0)
        w.add_rope_scaling_orig_ctx_len(raw["original_max_position_embeddings"])
    if arch in (MODEL_ARCH.GEMMA2, MODEL_ARCH.GEMMA3):
        w.add_sliding_window(raw["sliding_window"])
        w.add_final_logit_softcapping(raw["final_logit_softcapping"])
    if arch == MODEL_ARCH.GEMMA2:
        w.add_attn_logit_softcapping(raw["attn_logit_softcapping"])
    if arch == MODEL_ARCH.GEMMA3:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    _write_vocab(w, raw["vocab_size"], raw["bos_token_id"], raw["eos_token_id"])
    names = gguf.get_tensor_name_map(arch, layers)
    permuted = arch in (MODEL_ARCH.LLAMA, MODEL_ARCH.GRANITE, MODEL_ARCH.SMOLLM3)
    for key, t in state.items():
        gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, key
        if permuted and key.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif permuted and key.endswith("k_proj.weight"):
            t = _permute(t, kv)
        if arch in (MODEL_ARCH.GEMMA2, MODEL_ARCH.GEMMA3) and key.endswith("norm.weight"):
            t = t + 1
        w.add_tensor(gguf_name, t.float().numpy())
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    name = request.param
    model_type, arch, settings = CASES[name]
    root = tmp_path_factory.mktemp(name.replace(".", "_"))
    hf_dir = write_tiny_family(root / "m", model_type, **settings)
    return name, hf_dir, convert(hf_dir, arch, root / "m.gguf")


def test_gguf_logits_match_transformers(case: tuple[str, Path, Path]) -> None:
    name, hf_dir, path = case
    ckpt = load_dir(path)
    drv = make_driver(ckpt, page_size=PAGE_SIZE, num_pages=len(PAGES))
    toks = random_tokens(PROMPT + STEPS, 256, seed=len(name))
    ours = [drv.logits(forward([request(toks[:PROMPT], 0, PAGES, PAGE_SIZE, all_rows=True)]))]
    for i in range(PROMPT, PROMPT + STEPS):
        ours.append(drv.logits(forward([request(toks[i : i + 1], i, PAGES, PAGE_SIZE)])))
    with torch.no_grad():
        ref = hf_model(hf_dir)(torch.tensor([toks])).logits[0]
    torch.testing.assert_close(torch.cat(ours), ref, atol=1e-4, rtol=0)


def _rewrite(src: Path, dst: Path, arch: str | None = None, extra: dict[str, np.ndarray] | None = None) -> Path:
    """`src` with another architecture name or extra tensors."""
    reader = gguf.GGUFReader(src)
    old = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch or old)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        key = field.name.replace(f"{old}.", f"{arch}.", 1) if arch else field.name
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("refusals")
    return convert(write_tiny_family(root / "m", "llama", num_hidden_layers=1), MODEL_ARCH.LLAMA, root / "m.gguf")


def test_an_unknown_architecture_is_refused_naming_those_supported(llama_gguf: Path, tmp_path: Path) -> None:
    path = _rewrite(llama_gguf, tmp_path / "x.gguf", arch="falcon")
    with pytest.raises(ConfigRejected, match=r"GGUF architecture 'falcon' is not supported \(llama, qwen2"):
        load_dir(path)


def test_an_unknown_tensor_is_refused_by_name(llama_gguf: Path, tmp_path: Path) -> None:
    path = _rewrite(llama_gguf, tmp_path / "x.gguf", extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4), np.float32)})
    with pytest.raises(ConfigRejected, match=r"GGUF tensor blk\.0\.ffn_gate_exps\.weight is not supported for llama"):
        load_dir(path)


def test_rope_freqs_other_than_llama3s_are_refused(llama_gguf: Path, tmp_path: Path) -> None:
    path = _rewrite(llama_gguf, tmp_path / "x.gguf", extra={"rope_freqs.weight": np.full(8, 3.0, np.float32)})
    with pytest.raises(ConfigRejected, match="rope_freqs are not Llama 3's RoPE scaling"):
        load_dir(path)


# ---------------------------------------------------------------- SentencePiece vocabularies

SPACE = "\u2581"
PIECES = ["th", "he", "the", "in", "ing", "an", "er", "re", "on", "at", "ab", "bc", "abc", "cd", "bcd", "é", "ll", "lo"]


def _spm_vocab(seed: int) -> tuple[list[str], list[float], list[int]]:
    """Llama 2's layout: <unk>, <s>, </s>, 256 byte tokens, then pieces with random scores
    (so that which pair merges first differs from the pieces' order), ▁ in front of some."""
    rng = np.random.default_rng(seed)
    pieces = list(dict.fromkeys([SPACE, *"abcdefghijklmnopqrstuvwxyz.,!", *PIECES, *(SPACE + p for p in PIECES)]))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [float(x) for x in rng.normal(0, 5, len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def _spm_reference(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm (with its space prefix and ▁ escaping), written out: merge
    the adjacent pair that makes the highest-scoring token (leftmost on ties) until none does;
    what is left outside the vocabulary goes out as byte tokens."""
    ids = {t: i for i, t in enumerate(tokens)}
    symbols = list((" " + text).replace(" ", SPACE))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in ids and (best is None or scores[ids[joined]] > scores[ids[symbols[best] + symbols[best + 1]]]):
                best = i
        if best is None:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    out: list[int] = []
    for s in symbols:
        out.extend([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sentencepiece_vocabulary_encodes_as_llama_cpp_and_decodes_back(seed: int, tmp_path: Path) -> None:
    from drivers.torch.weights.gguf_tokenizer import load_gguf_tokenizer

    tokens, scores, types = _spm_vocab(seed)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = load_gguf_tokenizer(gguf.GGUFReader(tmp_path / "t.gguf"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.control_token_ids) == (1, 2, (1, 2))
    texts = ["the abcd thing", "  leading spaces and  double", "abc bcd cdab, hello!", "café ☃ 日本", "Zebra\nline"]
    for text in texts:
        enc = tok.tokenizer.encode(text, add_special_tokens=False).ids
        assert enc == _spm_reference(text, tokens, scores), text
        assert tok.tokenizer.decode(enc) == text
    assert tok.tokenizer.encode("<s>the</s>", add_special_tokens=False).ids[0] == 1
