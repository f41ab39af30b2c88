"""The token table from the driver's tokenizer description: bytes and byte-level BPE, control
and stop tokens empty, typed errors, and one table per tokenizer."""

from __future__ import annotations

import json

import pytest

from bridge_schema.messages import Handshake
from host.grammar import TokenizerSpec, TokenizerUnsupported, token_table, tokenizer_info
from host.grammar.tokenizer_info import _decode_byte_level, _decode_metaspace

from .conftest import BYTE_CONTROL, BYTE_STOPS


def test_bytes_table_has_bytes_then_empty_control_tokens(byte_spec: TokenizerSpec) -> None:
    table = token_table(byte_spec)
    assert table[:256] == [bytes([i]) for i in range(256)]
    assert table[256:] == [b""] * 4
    info = tokenizer_info(byte_spec)
    assert info.vocab_size == 260
    assert sorted(info.stop_token_ids) == sorted(BYTE_STOPS)
    assert set(info.special_token_ids) | set(BYTE_STOPS) == set(BYTE_CONTROL)


def test_spec_from_handshake_and_one_info_per_tokenizer() -> None:
    import numpy as np

    hs = Handshake(
        vocab_size=260,
        tokenizer_kind="bytes",
        stop_token_ids=np.array([258, 256], np.uint32),
        control_token_ids=np.array([259, 256, 257, 258], np.uint32),
    )
    spec = TokenizerSpec.from_handshake(hs)
    assert spec == TokenizerSpec.create("bytes", 260, [256, 258], [256, 257, 258, 259])
    assert tokenizer_info(spec) is tokenizer_info(TokenizerSpec.create("bytes", 260, [258, 256], BYTE_CONTROL))


def test_byte_level_alphabet_round_trips_every_byte() -> None:
    # "Ġ" is a space, "Ċ" a newline; printable ASCII stands for itself.
    assert _decode_byte_level("Ġhello") == b" hello"
    assert _decode_byte_level("Ċ") == b"\n"
    assert _decode_byte_level("Ã©") == "é".encode()
    for char, byte in zip("ĀāĂ!~¡", (0, 1, 2, 33, 126, 161), strict=True):
        assert _decode_byte_level(char) == bytes([byte])


def test_metaspace_tokens_decode_spaces_and_byte_fallback() -> None:
    assert _decode_metaspace("\u2581hello") == b" hello"
    assert _decode_metaspace("<0x0A>") == b"\n"
    assert _decode_metaspace("<0xZZ>") == b"<0xZZ>"


def _hf_json(vocab: dict[str, int], added: list[dict[str, object]], decoder: str = "ByteLevel") -> str:
    return json.dumps(
        {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "decoder": {"type": decoder}, "added_tokens": added}
    )


def test_huggingface_table_added_tokens_and_padding() -> None:
    data = _hf_json(
        {"a": 0, "Ġb": 1, "<|x|>": 2, "<tag>": 3},
        [{"id": 2, "content": "<|x|>", "special": True}, {"id": 3, "content": "<tag>", "special": False}],
    )
    spec = TokenizerSpec.create("huggingface", 8, [2], [2], data)
    assert token_table(spec) == [b"a", b" b", b"", b"<tag>", b"", b"", b"", b""]
    # A special token that is also neither stop nor control is still not text.
    spec = TokenizerSpec.create("huggingface", 4, [], [], data)
    assert token_table(spec)[2] == b""


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (TokenizerSpec.create("sentencepiece", 10, [], []), "unknown tokenizer kind"),
        (TokenizerSpec.create("bytes", 100, [], []), "at least 256"),
        (TokenizerSpec.create("bytes", 260, [300], []), "outside the vocabulary"),
        (TokenizerSpec.create("huggingface", 10, [], [], "{not json"), "no readable model.vocab"),
        (TokenizerSpec.create("huggingface", 10, [], [], _hf_json({"a": 0}, [], "WordPiece")), "byte-level"),
    ],
)
def test_unusable_tokenizers_raise_typed_errors(spec: TokenizerSpec, words: str) -> None:
    with pytest.raises(TokenizerUnsupported, match=words):
        token_table(spec)
