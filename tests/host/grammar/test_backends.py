"""The two engines behind one Matcher: llguidance's state behaves like xgrammar's, and "auto"
sends each schema to the engine that enforces it (with the byte tokenizer)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from host.grammar import GrammarCompiler, InvalidJSONSchema, InvalidToolCall, UnsupportedSchema, allocate_bitmask
from host.grammar.schema_one_of import exclusive_one_of_as_any_of

from .conftest import BYTE_STOPS

STOP = BYTE_STOPS[0]
OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def _accepts(compiler: GrammarCompiler, schema: Any, text: str, **options: Any) -> bool:
    matcher = compiler.json_schema(schema, **options).matcher()
    return matcher.accept_tokens(_bytes(text)) == len(text.encode()) and matcher.accept(STOP)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_matcher_semantics_are_the_same_on_both_engines(byte_compiler: GrammarCompiler, backend: str) -> None:
    grammar = byte_compiler.json_schema(OBJECT, backend=backend)
    assert grammar.backend == backend
    matcher = grammar.matcher()
    assert not matcher.accept(ord("x"))  # refused: the state is unchanged
    assert not matcher.accept(STOP)  # a stop only where the grammar may end
    assert matcher.accept_tokens(_bytes('{"a":1')) == 6
    assert not matcher.is_completed()
    twin = matcher.fork()
    assert matcher.accept(ord("}")) and matcher.is_completed() and not matcher.is_terminated()
    assert matcher.accept(STOP) and matcher.is_terminated()
    assert not matcher.accept(ord(" "))
    matcher.rollback(2)  # the stop and the brace: live again
    assert not matcher.is_terminated() and matcher.accept(ord("2"))
    assert twin.num_accepted == 6 and twin.accept(ord("}")) and twin.accept(STOP)
    matcher.reset()
    assert matcher.num_accepted == 0 and matcher.jump_forward() == '{"a":'


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_masks_allow_exactly_the_accepted_tokens(byte_compiler: GrammarCompiler, backend: str) -> None:
    matcher = byte_compiler.json_schema(OBJECT, backend=backend).matcher()
    matcher.accept_tokens(_bytes('{"a":1'))
    mask = allocate_bitmask(matcher.vocab_size)
    assert matcher.fill_bitmask(mask)
    allowed = {i for i in range(matcher.vocab_size) if mask[i // 32] >> (i % 32) & 1}
    assert allowed == {ord(c) for c in "0123456789}"}
    for token in range(256):
        probe = matcher.fork()
        assert probe.accept(token) == (token in allowed)


def test_llguidance_ignores_a_clients_x_guidance_options(byte_compiler: GrammarCompiler) -> None:
    schema = {**OBJECT, "x-guidance": {"lenient": True, "whitespace_flexible": True}}
    assert not _accepts(byte_compiler, schema, '{ "a": 1 }', backend="llguidance")
    with pytest.raises(UnsupportedSchema, match="uniqueItems"):  # lenient stays off
        byte_compiler.json_schema(
            {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, backend="llguidance"
        )


@pytest.mark.parametrize(
    ("schema", "invalid", "valid"),
    [
        ({"minLength": 3}, '"ab"', "7"),
        ({"maximum": 5}, "7", '"text"'),
        ({"pattern": "^a"}, '"b"', '"abc"'),
        ({"maxItems": 1}, "[1,2]", "[1]"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "{}", '{"a":1}'),
    ],
)
@pytest.mark.parametrize("strict", [True, False])
def test_auto_enforces_what_xgrammar_drops(
    byte_compiler: GrammarCompiler, schema: dict[str, Any], invalid: str, valid: str, strict: bool
) -> None:
    """Keywords of a node without `type`, or beside anyOf, which xgrammar 0.2.8 compiles as
    "any JSON" (test_schema_support measures that): auto takes llguidance, which holds them,
    also in strict mode, where xgrammar would otherwise be first."""
    grammar = byte_compiler.json_schema(schema, strict=strict, reject_unsupported=True)
    assert (grammar.backend, grammar.unsupported) == ("llguidance", ())
    assert not _accepts(byte_compiler, schema, invalid, strict=strict, reject_unsupported=True)
    assert _accepts(byte_compiler, schema, valid, strict=strict, reject_unsupported=True)


def test_auto_prefers_xgrammar_where_it_enforces_everything(byte_compiler: GrammarCompiler) -> None:
    assert byte_compiler.json_schema(OBJECT, strict=True).backend == "xgrammar"
    assert byte_compiler.json_schema(OBJECT, strict=False).backend == "llguidance"  # xgrammar is slow there


def test_json_schema_semantics_unless_strict(byte_compiler: GrammarCompiler) -> None:
    extra = '{"a":1,"b":true}'
    assert _accepts(byte_compiler, OBJECT, extra, strict=False)
    assert not _accepts(byte_compiler, OBJECT, extra, strict=True)
    closed = {**OBJECT, "additionalProperties": False}
    assert not _accepts(byte_compiler, closed, extra, strict=False)
    # Both engines read strict mode alike: declared properties close an object, a bare one is open.
    for backend in ("xgrammar", "llguidance"):
        assert not _accepts(byte_compiler, OBJECT, extra, strict=True, backend=backend)
        assert _accepts(byte_compiler, {"type": "object"}, '{"b":1}', strict=True, backend=backend)


def test_unknown_formats_are_annotations_and_checked_ones_are_enforced(byte_compiler: GrammarCompiler) -> None:
    for fmt in ("url", "path", "datetime", "int32", "color"):  # no validator checks these
        assert _accepts(byte_compiler, {"type": "string", "format": fmt}, '"anything at all"', reject_unsupported=True)
    assert not _accepts(byte_compiler, {"type": "string", "format": "date"}, '"2020-13-45x"', reject_unsupported=True)
    # Checked by a validator in any draft, so enforced even in a draft-04 schema.
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "string", "format": "uuid"}
    assert not _accepts(byte_compiler, draft4, '"not-a-uuid"', reject_unsupported=True)
    with pytest.raises(UnsupportedSchema, match="format 'idn-email'"):  # checked, enforced by neither
        byte_compiler.json_schema({"type": "string", "format": "idn-email"}, reject_unsupported=True)


def test_one_of_proved_exclusive_becomes_any_of() -> None:
    by_type = {"oneOf": [{"type": "string"}, {"type": "null"}]}
    assert exclusive_one_of_as_any_of(by_type) == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    tagged = {
        "$defs": {"a": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]}},
        "oneOf": [
            {"$ref": "#/$defs/a"},
            {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]},
        ],
    }
    assert "anyOf" in exclusive_one_of_as_any_of(tagged)
    # Not provable: overlapping types, an untyped branch, a discriminator not required by both.
    for branches in (
        [{"type": "integer"}, {"type": "number"}],
        [{"type": "string"}, {"minimum": 1}],
        [{"type": "array", "items": {"type": "string"}}, {"type": "array", "items": {"type": "number"}}],
        [
            {"type": "object", "properties": {"k": {"const": "a"}}},
            {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
        ],
    ):
        assert "oneOf" in exclusive_one_of_as_any_of({"oneOf": branches}), json.dumps(branches)


def test_one_of_left_unproved_is_refused(byte_compiler: GrammarCompiler) -> None:
    with pytest.raises(UnsupportedSchema, match="oneOf"):
        byte_compiler.json_schema({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, reject_unsupported=True)
    grammar = byte_compiler.json_schema({"oneOf": [{"type": "integer"}, {"type": "string"}]}, reject_unsupported=True)
    assert _accepts(byte_compiler, {"oneOf": [{"type": "integer"}, {"type": "string"}]}, '"x"', reject_unsupported=True)
    assert grammar.unsupported == ()


def test_mask_bits_are_uint32_words_on_llguidance(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.json_schema(OBJECT, backend="llguidance").matcher()
    mask = allocate_bitmask(matcher.vocab_size)
    matcher.fill_bitmask(mask)
    assert mask.dtype == np.uint32 and mask[ord("{") // 32] == 1 << (ord("{") % 32)


TOOL_PARAMS = {"type": "object", "properties": {"city": {"maxLength": 4}}, "required": ["city"]}  # untyped


def test_forced_and_required_tool_calls_go_to_llguidance_where_xgrammar_drops_keywords(
    byte_compiler: GrammarCompiler,
) -> None:
    tools = [
        {"name": "forecast", "parameters": TOOL_PARAMS},
        {"name": "alarm", "parameters": {"type": "object", "properties": {"hour": {"type": "integer"}}}},
    ]
    for choice in ("forecast", "required"):
        grammar = byte_compiler.tool_call(tools, choice=choice, reject_unsupported=True)
        assert (grammar.backend, grammar.unsupported) == ("llguidance", ())

        def accepts(text: str, grammar: Any = grammar) -> bool:
            matcher = grammar.matcher()
            return matcher.accept_tokens(_bytes(text)) == len(text.encode()) and matcher.accept(STOP)

        assert accepts('{"name":"forecast","arguments":{"city":"Oslo"}}')
        assert not accepts('{"name":"forecast","arguments":{"city":"Bergen"}}')  # maxLength 4 held
        assert accepts('{"name":"forecast","arguments":{"city":7}}')  # untyped: any non-string too
        assert not accepts('{"name":"forecast","arguments":{"city":"Oslo","x":1}}')  # strict
        assert not accepts('{"name":"forecast", "arguments":{"city":"Oslo"}}')  # compact
        assert accepts('{"name":"alarm","arguments":{"hour":7}}') == (choice == "required")
    # auto (free text with calls) stays xgrammar's, so the dropped keyword is refused by name.
    with pytest.raises(UnsupportedSchema, match="maxLength without type at /properties/city in tool 'forecast'"):
        byte_compiler.tool_call(tools, choice="auto", reject_unsupported=True)
    # Tools xgrammar enforces whole stay on xgrammar.
    assert byte_compiler.tool_call(tools[1:], choice="required").backend == "xgrammar"


def test_an_unknown_backend_is_refused_naming_the_choices(byte_compiler: GrammarCompiler) -> None:
    with pytest.raises(InvalidJSONSchema, match="unknown backend 'outlines'; expected one of auto, xgrammar"):
        byte_compiler.json_schema(OBJECT, backend="outlines")
    with pytest.raises(InvalidToolCall, match="unknown backend"):
        byte_compiler.tool_call([{"name": "f", "parameters": OBJECT}], backend="outlines")
