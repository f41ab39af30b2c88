"""The real SmolLM2 tokenizer (49,152 tokens, 17 control tokens, EOS 2 `<|im_end|>`): the
token table decodes like the tokenizer, control tokens never enter JSON, walks validate."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from host.grammar import GrammarCompiler, TokenizerSpec, allocate_bitmask, token_table

from .conftest import SMOL_EOS
from .walk import allowed_ids, walk

IM_START = 1

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "rating": {"enum": ["G", "PG", "R"]},
    },
    "required": ["title", "year"],
}


@pytest.fixture(scope="session")
def smol_table(smol_spec: TokenizerSpec) -> list[bytes]:
    return token_table(smol_spec)


def test_table_matches_the_tokenizers_own_decoding(smol_table: list[bytes], smol_tokenizer: Any) -> None:
    control = set(range(17))
    assert smol_tokenizer.id_to_token(IM_START) == "<|im_start|>"
    assert smol_tokenizer.id_to_token(SMOL_EOS) == "<|im_end|>"
    assert all(smol_table[i] == b"" for i in control)
    checked = 0
    for token_id in range(len(smol_table)):
        if token_id in control:
            continue
        try:
            text = smol_table[token_id].decode("utf-8")
        except UnicodeDecodeError:
            continue  # part of a multi-byte character: the tokenizer shows U+FFFD
        assert smol_tokenizer.decode([token_id]) == text, token_id
        checked += 1
    assert checked > 45_000


def test_im_start_is_never_allowed_inside_a_json_string(smol_compiler: GrammarCompiler, smol_tokenizer: Any) -> None:
    matcher = smol_compiler.json_schema(SCHEMA).matcher()
    mask = allocate_bitmask(matcher.vocab_size)
    prefix = smol_tokenizer.encode('{"title":"Hello').ids
    assert matcher.accept_tokens(prefix) == len(prefix)
    matcher.fill_bitmask(mask)
    allowed = set(allowed_ids(mask, matcher.vocab_size).tolist())
    assert len(allowed) > 40_000, "a string allows most text tokens"
    assert not allowed & set(range(17)), "no control token (nor EOS) inside a string"
    assert not matcher.accept(IM_START)
    # Written out as text, the control token's spelling is only ordinary characters.
    literal = smol_tokenizer.encode("<|im_start|>").ids
    assert literal == [IM_START]


def test_any_json_object_refuses_control_tokens_everywhere(smol_compiler: GrammarCompiler) -> None:
    matcher = smol_compiler.json_object().matcher()
    mask = allocate_bitmask(matcher.vocab_size)
    rng = random.Random(3)
    for _ in range(30):
        matcher.fill_bitmask(mask)
        allowed = allowed_ids(mask, matcher.vocab_size).tolist()
        assert not set(allowed) & set(range(17)) - {SMOL_EOS}
        if SMOL_EOS in allowed:
            break
        assert matcher.accept(rng.choice(allowed))


@pytest.mark.parametrize("seed", range(4))
def test_schema_walk_with_real_tokens_validates(
    smol_compiler: GrammarCompiler, smol_table: list[bytes], seed: int
) -> None:
    closers = [i for i, b in enumerate(smol_table) if b and set(b) <= set(b'"}]0123456789')]
    tokens = walk(smol_compiler.json_schema(SCHEMA).matcher(), random.Random(seed), soft_steps=12, prefer=closers)
    assert tokens[-1] == SMOL_EOS
    text = b"".join(smol_table[t] for t in tokens[:-1]).decode("utf-8")
    jsonschema.validate(json.loads(text), SCHEMA)
