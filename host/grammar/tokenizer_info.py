"""The grammar engine's token table (xgrammar `TokenizerInfo`), built from the driver's tokenizer
description: kind, tokenizer.json text, vocabulary size, stop and control token ids.

Knows nothing of Hugging Face model repositories: the table is decoded here, token by token, so
control tokens get an empty string and can never appear inside grammar text (xgrammar's own
`from_huggingface` treats `<|im_start|>` as text and allows it inside JSON strings).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import xgrammar as xgr

from bridge_schema.messages import Handshake
from host.grammar.errors import TokenizerUnsupported

# Token tables are large (49k entries for SmolLM2, ~0.1 s to build); a host serves few models.
_TABLE_CACHE_SIZE = 8


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What the driver's handshake says about its tokenizer; hashable, so it keys caches."""

    kind: str  # "bytes" | "huggingface"
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    control_token_ids: tuple[int, ...]
    data: str = ""  # tokenizer.json text for "huggingface"

    @classmethod
    def create(
        cls,
        kind: str,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        control_token_ids: Iterable[int],
        data: str = "",
    ) -> TokenizerSpec:
        return cls(kind, int(vocab_size), _ids(stop_token_ids), _ids(control_token_ids), data)

    @classmethod
    def from_handshake(cls, handshake: Handshake) -> TokenizerSpec:
        return cls.create(
            handshake.tokenizer_kind,
            handshake.vocab_size,
            handshake.stop_token_ids,
            handshake.control_token_ids,
            handshake.tokenizer_data,
        )

    @property
    def cache_key(self) -> CacheKey:
        digest = hashlib.sha256(self.data.encode("utf-8")).hexdigest()
        return (self.kind, self.vocab_size, self.stop_token_ids, self.control_token_ids, digest)


def _ids(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({int(i) for i in ids}))


def token_table(spec: TokenizerSpec) -> list[bytes]:
    """The bytes each token id stands for, `vocab_size` entries; b"" for control, stop, unused ids."""
    _validate(spec)
    if spec.kind == "bytes":
        table = [bytes([i]) for i in range(256)] + [b""] * (spec.vocab_size - 256)
    elif spec.kind == "huggingface":
        table = _huggingface_table(spec.data, spec.vocab_size)
    else:
        raise TokenizerUnsupported(f"unknown tokenizer kind {spec.kind!r} (expected 'bytes' or 'huggingface')")
    for token_id in (*spec.control_token_ids, *spec.stop_token_ids):
        table[token_id] = b""
    return table


def _validate(spec: TokenizerSpec) -> None:
    if spec.kind == "bytes" and spec.vocab_size < 256:
        raise TokenizerUnsupported(f"a bytes tokenizer needs a vocabulary of at least 256, got {spec.vocab_size}")
    if spec.vocab_size <= 0:
        raise TokenizerUnsupported(f"vocab_size must be positive, got {spec.vocab_size}")
    bad = [t for t in (*spec.stop_token_ids, *spec.control_token_ids) if not 0 <= t < spec.vocab_size]
    if bad:
        raise TokenizerUnsupported(f"stop/control token ids {bad} are outside the vocabulary of {spec.vocab_size}")


# ------------------------------------------------------------------ Hugging Face tokenizer.json


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each printable stand-in character -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codepoints = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codepoints.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, codepoints, strict=True)}


_BYTE_LEVEL = _byte_level_decoder()


def _decode_byte_level(token: str) -> bytes:
    # A character outside the alphabet cannot come from byte-level BPE; keep it as UTF-8 text.
    return b"".join(bytes([_BYTE_LEVEL[ch]]) if ch in _BYTE_LEVEL else ch.encode("utf-8") for ch in token)


def _decode_metaspace(token: str) -> bytes:
    """SentencePiece style: "▁" is a space and "<0xNN>" is a raw byte (byte fallback)."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("\u2581", " ").encode("utf-8")


def _component_types(node: Any) -> set[str]:
    if not isinstance(node, dict):
        return set()
    found = {str(node.get("type", ""))}
    for key in ("decoders", "pretokenizers"):
        for child in node.get(key) or ():
            found |= _component_types(child)
    return found


def _huggingface_table(data: str, vocab_size: int) -> list[bytes]:
    try:
        doc = json.loads(data)
        vocab: Any = doc["model"]["vocab"]
    except (ValueError, KeyError, TypeError) as exc:
        raise TokenizerUnsupported(f"the driver's tokenizer.json has no readable model.vocab: {exc}") from None
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids by position
        vocab = {str(entry[0]): i for i, entry in enumerate(vocab)}
    if not isinstance(vocab, dict):
        raise TokenizerUnsupported("the driver's tokenizer.json model.vocab is neither a map nor a list")
    kinds = _component_types(doc.get("decoder")) | _component_types(doc.get("pre_tokenizer"))
    if "ByteLevel" in kinds:
        decode = _decode_byte_level
    elif kinds & {"Metaspace", "ByteFallback", "Replace"}:
        decode = _decode_metaspace
    else:
        raise TokenizerUnsupported(
            f"grammars need a byte-level or SentencePiece-style tokenizer; this one decodes with {sorted(kinds)}"
        )
    table = [b""] * vocab_size
    for token, token_id in vocab.items():
        if 0 <= int(token_id) < vocab_size:
            table[int(token_id)] = decode(str(token))
    # Added tokens are literal text, not byte-level encoded; special ones are not text at all.
    for added in doc.get("added_tokens") or ():
        token_id = int(added["id"])
        if 0 <= token_id < vocab_size:
            table[token_id] = b"" if added.get("special") else str(added["content"]).encode("utf-8")
    return table


# ------------------------------------------------------------------ cached TokenizerInfo

T = TypeVar("T")
CacheKey = tuple[str, int, tuple[int, ...], tuple[int, ...], str]


class PerTokenizer(Generic[T]):
    """What an engine builds once per tokenizer (a token table: 49k entries for SmolLM2, about
    0.1 s), kept for the last few tokenizers (a host serves few models). Thread-safe; two
    threads building the same one both succeed and the first stored is kept."""

    def __init__(self, build: Callable[[TokenizerSpec], T], size: int = _TABLE_CACHE_SIZE) -> None:
        self._build = build
        self._size = size
        self._cache: OrderedDict[CacheKey, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, spec: TokenizerSpec) -> T:
        key = spec.cache_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        built = self._build(spec)
        with self._lock:
            built = self._cache.setdefault(key, built)
            self._cache.move_to_end(key)
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return built


def tokenizer_info(spec: TokenizerSpec) -> xgr.TokenizerInfo:
    """The xgrammar token table for `spec`, built once per tokenizer."""
    return _infos.get(spec)


def _build(table: Sequence[bytes], vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(list(table), xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


_infos: PerTokenizer[xgr.TokenizerInfo] = PerTokenizer(
    lambda spec: _build(token_table(spec), spec.vocab_size, spec.stop_token_ids)
)
