"""Random walks under the mask, byte tokenizer (256 bytes + control tokens 256..259, stops 258
and 256): every kind ends in output that parses or matches, and control tokens never appear."""

from __future__ import annotations

import ast
import json
import random
import re

import jsonschema
import pytest

from host.grammar import GrammarCompiler, TokenizerSpec, token_table

from .conftest import BYTE_CONTROL, BYTE_STOPS
from .walk import CLOSERS, walk

SEEDS = range(12)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"const": "person"},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


def _output(spec: TokenizerSpec, tokens: list[int]) -> str:
    """The text of a finished walk: all bytes, then exactly one stop token, no control tokens."""
    assert tokens[-1] in BYTE_STOPS
    body = tokens[:-1]
    assert not any(t in BYTE_CONTROL for t in body), body
    return b"".join(token_table(spec)[t] for t in body).decode("utf-8")


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_walk_validates(byte_compiler: GrammarCompiler, byte_spec: TokenizerSpec, seed: int) -> None:
    grammar = byte_compiler.json_schema(SCHEMA)
    tokens = walk(grammar.matcher(), random.Random(seed), prefer=CLOSERS)
    text = _output(byte_spec, tokens)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False), "compact JSON"


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_walk_parses(byte_compiler: GrammarCompiler, byte_spec: TokenizerSpec, seed: int) -> None:
    tokens = walk(byte_compiler.json_object().matcher(), random.Random(seed), prefer=CLOSERS)
    assert isinstance(json.loads(_output(byte_spec, tokens)), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_value_walk_parses(byte_compiler: GrammarCompiler, byte_spec: TokenizerSpec, seed: int) -> None:
    tokens = walk(byte_compiler.json_value().matcher(), random.Random(seed), prefer=CLOSERS)
    json.loads(_output(byte_spec, tokens))


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_walk_matches(byte_compiler: GrammarCompiler, byte_spec: TokenizerSpec, seed: int) -> None:
    pattern = r"(yes|no|[a-c]{2,4}-\d{1,3})(\.[xyz]+)?"
    tokens = walk(byte_compiler.regex(pattern).matcher(), random.Random(seed))
    assert re.fullmatch(pattern, _output(byte_spec, tokens))


EBNF = r"""
root ::= expr
expr ::= term ("+" term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]*
"""


@pytest.mark.parametrize("seed", SEEDS)
def test_ebnf_walk_parses(byte_compiler: GrammarCompiler, byte_spec: TokenizerSpec, seed: int) -> None:
    tokens = walk(byte_compiler.ebnf(EBNF).matcher(), random.Random(seed), prefer=tuple(b")0123456789"))
    text = _output(byte_spec, tokens)
    assert re.fullmatch(r"[0-9+()]+", text)
    tree = ast.parse(text, mode="eval")  # only ints, + and parentheses: the grammar's language
    assert all(isinstance(n, ast.Expression | ast.BinOp | ast.Add | ast.Constant) for n in ast.walk(tree))


def test_control_tokens_never_allowed_inside_a_grammar(byte_compiler: GrammarCompiler) -> None:
    """At every step of a walk, control tokens are masked out; stops only where the grammar ends."""
    from host.grammar import allocate_bitmask

    from .walk import allowed_ids

    matcher = byte_compiler.json_schema(SCHEMA).matcher()
    rng = random.Random(7)
    mask = allocate_bitmask(matcher.vocab_size)
    while not matcher.is_terminated():
        matcher.fill_bitmask(mask)
        allowed = set(allowed_ids(mask, matcher.vocab_size).tolist())
        assert not allowed & {257, 259}, "non-stop control tokens are never allowed"
        stops_allowed = allowed & set(BYTE_STOPS)
        assert bool(stops_allowed) == matcher.is_completed()
        if stops_allowed:
            assert stops_allowed == set(BYTE_STOPS)
        for control in BYTE_CONTROL:
            if control not in allowed:
                assert not matcher.accept(control)
        choice = sorted(stops_allowed) or sorted(allowed & set(CLOSERS)) or sorted(allowed)
        assert matcher.accept(rng.choice(choice))
