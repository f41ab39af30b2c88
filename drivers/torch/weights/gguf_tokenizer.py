"""A Hugging Face `tokenizers` tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata:
byte-level BPE ("gpt2") or SentencePiece ("llama": Llama 2, Mistral v0.1, Gemma), the latter as
llama.cpp's llm_tokenizer_spm runs it. Knows the GGUF metadata keys, not the model weights."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from drivers.errors import ConfigRejected

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp token types (control: <|im_end|>, <s>)
SPACE = "\u2581"  # SentencePiece's space marker

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
    if kind not in ("gpt2", "llama"):
        raise ConfigRejected(
            f"GGUF tokenizer model {kind!r} is not supported (gpt2: byte-level BPE, llama: SentencePiece)", "model"
        )
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]  # type: ignore[attr-defined]
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]  # type: ignore[attr-defined]
    tok = _byte_level_bpe(reader, tokens) if kind == "gpt2" else _sentencepiece(reader, tokens, types)
    control = tuple(i for i, t in enumerate(types) if t == CONTROL)
    # Ids are kept: the tokens already sit in the vocabulary at these ids.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    tok.add_tokens(
        [AddedToken(t, normalized=False) for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED]
    )
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS by default for SentencePiece vocabularies, not for byte-level BPE.
    add_bos = bool(
        _field(reader, "tokenizer.ggml.add_bos_token")
        if _has(reader, "tokenizer.ggml.add_bos_token")
        else kind == "llama"
    )
    return GGUFTokenizer(
        tokenizer=tok,
        chat_template=str(_field(reader, "tokenizer.chat_template") or ""),
        control_token_ids=control,
        eos_token_id=int(eos) if eos is not None else -1,  # type: ignore[call-overload]
        bos_token_id=int(bos) if (bos is not None and add_bos) else None,  # type: ignore[call-overload]
    )


def _has(reader: gguf.GGUFReader, key: str) -> bool:
    return key in reader.fields


def _byte_level_bpe(reader: gguf.GGUFReader, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]  # type: ignore[attr-defined]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = str(_field(reader, "tokenizer.ggml.pre") or "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLITTING and pre != "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> Tokenizer:
    """llama.cpp's SentencePiece tokenizer as a BPE: it starts from single characters and merges
    the adjacent pair whose join is the vocabulary's highest-scoring token, then spells what no
    token covers as <0xNN> byte tokens. A BPE whose merges are every split of every token into
    two tokens, ranked by the joined token's score, makes the same choices."""
    scores = [float(x) for x in _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)]  # type: ignore[attr-defined]
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, kind in zip(tokens, types, strict=True) if kind in (NORMAL, USER_DEFINED)}
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for token in mergeable:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[vocab[token]], vocab[left], vocab[right], (left, right)))
    merges = [pair for *_, pair in sorted(ranked)]
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[int(unk)] if unk is not None else None,  # type: ignore[call-overload]
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    space_prefix = (
        bool(_field(reader, "tokenizer.ggml.add_space_prefix"))
        if _has(reader, "tokenizer.ggml.add_space_prefix")
        else True
    )
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(SPACE)] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    strip: list[decoders.Decoder] = [decoders.Strip(content=" ", left=1, right=0)] if space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok
