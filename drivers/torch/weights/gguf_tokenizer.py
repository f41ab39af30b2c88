"""A Hugging Face `tokenizers` tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata
(byte-level BPE, "gpt2" model). Knows the GGUF metadata keys, not the model weights."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from drivers.errors import ConfigRejected

CONTROL = 3  # llama.cpp token type of control tokens such as <|im_end|>

# llama.cpp pre-tokenizer names whose digits are split one by one before byte-level BPE.
_DIGIT_SPLITTING = {"smollm", "gpt-2", "default", "llama-bpe", "qwen2", "smaug-bpe"}


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    tokenizer: Tokenizer
    chat_template: str
    control_token_ids: tuple[int, ...]
    eos_token_id: int
    bos_token_id: int | None


def _field(reader: gguf.GGUFReader, key: str) -> object | None:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def load_gguf_tokenizer(reader: gguf.GGUFReader) -> GGUFTokenizer:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigRejected(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE)", "model")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))  # type: ignore[call-overload]
    types = list(_field(reader, "tokenizer.ggml.token_type"))  # type: ignore[call-overload]
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]  # type: ignore[attr-defined]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = str(_field(reader, "tokenizer.ggml.pre") or "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLITTING and pre != "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    control = tuple(i for i, t in enumerate(types) if t == CONTROL)
    # Ids are kept: the tokens already sit in the BPE vocabulary at these ids.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token"))
    return GGUFTokenizer(
        tokenizer=tok,
        chat_template=str(_field(reader, "tokenizer.chat_template") or ""),
        control_token_ids=control,
        eos_token_id=int(eos) if eos is not None else -1,  # type: ignore[call-overload]
        bos_token_id=int(bos) if (bos is not None and add_bos) else None,  # type: ignore[call-overload]
    )
