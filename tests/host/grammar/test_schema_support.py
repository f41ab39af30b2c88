"""The measured coverage of xgrammar 0.2.8 behind schema_coverage: each keyword listed as not
enforced really lets a violating instance through (and is reported), each enforced keyword
refuses one (and is not reported). A new xgrammar that changes either fails here."""

from __future__ import annotations

import json
from typing import Any

import pytest

from host.grammar import GrammarCompiler, UnsupportedSchema
from host.grammar.schema_coverage import unsupported_features
from host.grammar.schema_support import full_match_pattern, normalize

from .conftest import BYTE_STOPS

NOT_ENFORCED: list[tuple[str, dict[str, Any], Any]] = [
    ("not", {"type": "string", "not": {"const": "a"}}, "a"),
    ("if", {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, {"a": 1}),
    ("dependencies", {"type": "object", "dependencies": {"a": ["b"]}}, {"a": 1}),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ("uniqueItems", {"type": "array", "uniqueItems": True}, [1, 1]),
    ("contains", {"type": "array", "contains": {"const": 5}}, [1]),
    ("allOf (more than one subschema)", {"allOf": [{"type": "string"}, {"minLength": 3}]}, "a"),
    ("oneOf (matched as anyOf)", {"oneOf": [{"type": "integer"}, {"minimum": 0}]}, 1),
    ("multipleOf (only on integers without bounds)", {"type": "number", "multipleOf": 0.5}, 0.3),
    ("multipleOf (only on integers without bounds)", {"type": "integer", "minimum": 0, "multipleOf": 12}, 25),
    ("format 'iri'", {"type": "string", "format": "iri"}, "not an iri"),
    # A node without `type` loses its type-specific keywords: xgrammar allows any JSON there.
    ("minLength without type", {"minLength": 3}, "ab"),
    ("pattern without type", {"pattern": "^a"}, "b"),
    ("format without type", {"format": "date"}, "not a date"),
    ("maximum without type", {"maximum": 5}, 7),
    ("maxItems without type", {"maxItems": 1}, [1, 2]),
    ("minProperties without type", {"minProperties": 1}, {}),
    ("maxProperties without type", {"maxProperties": 1}, {"a": 1, "b": 2}),
    # A length beside a format or a pattern is dropped (xgrammar warns "format combined with
    # minLength/maxLength is not supported").
    ("maxLength beside format", {"type": "string", "format": "email", "maxLength": 5}, "abcdef@x.com"),
    ("minLength beside pattern", {"type": "string", "pattern": "^a", "minLength": 3}, "a"),
    # Keywords beside anyOf, enum and the like are dropped: the node is compiled from it alone.
    (
        "anyOf with other keywords beside it (properties type)",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
        {"a": "x"},
    ),
    ("enum with other keywords beside it (type)", {"type": "integer", "enum": ["a", 1]}, "a"),
    (
        "anyOf with other keywords beside it (minLength type)",
        {"type": "string", "minLength": 3, "anyOf": [{"type": "string"}]},
        "ab",
    ),
    ("required (a name not in properties)", {"type": "object", "required": ["a"]}, {}),
    # References xgrammar cannot follow compile as any JSON: an anchor, a dynamic reference.
    ("$ref '#i' (an anchor)", {"$ref": "#i", "$defs": {"i": {"$anchor": "i", "type": "integer"}}}, "x"),
    ("$dynamicRef", {"$dynamicRef": "#i", "$defs": {"i": {"$dynamicAnchor": "i", "type": "integer"}}}, "x"),
    ("$recursiveRef", {"$recursiveRef": "#/$defs/i", "$defs": {"i": {"type": "integer"}}}, "x"),
    (
        "patternProperties (ignored beside properties unless strict)",
        {"type": "object", "properties": {"b": {}}, "patternProperties": {"^a": {"type": "string"}}},
        {"a": 1},
    ),
]

ENFORCED: list[tuple[str, dict[str, Any], Any]] = [
    ("allOf of one", {"allOf": [{"type": "string", "minLength": 3}]}, "a"),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False},
        {"ab": "x"},
    ),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^a"}}, {"b": 1}),
    ("multipleOf on integers", {"type": "integer", "multipleOf": 3}, 4),
    ("minimum", {"type": "integer", "minimum": 3}, 2),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 3}, 3),
    ("maxLength", {"type": "string", "maxLength": 2}, "abc"),
    ("pattern", {"type": "string", "pattern": "^a+$"}, "b"),
    ("pattern is a search", {"type": "string", "pattern": "^pkg:"}, "xpkg:"),
    (
        "patternProperties is a search",
        {"type": "object", "patternProperties": {"_id": {"type": "integer"}}, "additionalProperties": False},
        {"my_id": "x"},
    ),
    ("format email", {"type": "string", "format": "email"}, "b"),
    ("format json-pointer", {"type": "string", "format": "json-pointer"}, "no leading slash"),
    ("format date-time", {"type": "string", "format": "date-time"}, "b"),
    ("minProperties", {"type": "object", "minProperties": 2}, {"a": 1}),
    ("maxProperties", {"type": "object", "maxProperties": 1}, {"a": 1, "b": 2}),
    ("minItems", {"type": "array", "minItems": 2}, [1]),
    ("enum", {"enum": [1, 2]}, 3),
    ("enum beside a type all its values have", {"type": "string", "enum": ["a", "b"]}, "c"),
    (
        "$ref beside keywords a draft-07 validator ignores",
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "$ref": "#/$defs/s",
            "$defs": {"s": {"type": "string"}},
            "minLength": 3,
        },
        1,
    ),
    ("const", {"const": "x"}, "y"),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, [1, 2]),
    ("additionalProperties", {"type": "object", "properties": {"a": {}}, "additionalProperties": False}, {"b": 1}),
    ("required", {"type": "object", "properties": {"a": {}}, "required": ["a"]}, {}),
]


def _accepts(compiler: GrammarCompiler, schema: dict[str, Any], instance: Any) -> bool:
    matcher = compiler.json_schema(schema, strict=False, backend="xgrammar").matcher()
    data = list(json.dumps(instance, separators=(",", ":")).encode())
    return matcher.accept_tokens(data) == len(data) and matcher.accept(BYTE_STOPS[0])


@pytest.mark.parametrize(("feature", "schema", "violation"), NOT_ENFORCED, ids=[f[0] for f in NOT_ENFORCED])
def test_keywords_not_enforced_are_reported(
    byte_compiler: GrammarCompiler, feature: str, schema: dict[str, Any], violation: Any
) -> None:
    assert _accepts(byte_compiler, schema, violation), f"xgrammar now enforces {feature}: update schema_coverage"
    assert f"{feature} at /" in unsupported_features(normalize(schema), strict=False)


@pytest.mark.parametrize(("feature", "schema", "violation"), ENFORCED, ids=[f[0] for f in ENFORCED])
def test_enforced_keywords_refuse_violations(
    byte_compiler: GrammarCompiler, feature: str, schema: dict[str, Any], violation: Any
) -> None:
    assert not _accepts(byte_compiler, schema, violation)
    assert unsupported_features(normalize(schema), strict=False) == ()


def test_features_carry_json_pointers() -> None:
    schema = {
        "$defs": {"a/b": {"not": {}}},
        "properties": {"x": {"items": [{"uniqueItems": True}]}},
        "anyOf": [{"if": {}}],
    }
    assert unsupported_features(normalize(schema), strict=True) == (
        "anyOf with other keywords beside it (properties) at /",
        "if at /anyOf/0",
        "not at /$defs/a~1b",
        "uniqueItems at /properties/x/prefixItems/0",
    )


def test_normalize_rewrites_older_drafts_only_where_needed() -> None:
    assert normalize({"minimum": 1, "exclusiveMinimum": True}) == {"exclusiveMinimum": 1}
    assert normalize({"maximum": 1, "exclusiveMaximum": False}) == {"maximum": 1}
    assert normalize({"items": [{}], "additionalItems": False}) == {"prefixItems": [{}], "items": False}
    assert normalize({"items": {}, "additionalItems": False}) == {"items": {}}
    assert normalize({"type": "array", "minItems": 1}) == {"type": "array", "minItems": 1, "items": {}}
    nested = {"properties": {"a": {"anyOf": [{"minimum": 0, "exclusiveMinimum": True}]}}}
    assert normalize(nested) == {"properties": {"a": {"anyOf": [{"exclusiveMinimum": 0}]}}}
    assert normalize(True) is True


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        ({"type": "string", "pattern": "^pkg:"}, "pkg:serializer"),
        ({"type": "string", "pattern": "b+"}, "abba"),
        ({"type": "string", "pattern": ""}, "anything"),
        (
            {"type": "object", "patternProperties": {"^S_": {"type": "integer"}}, "additionalProperties": False},
            {"S_x": 1},
        ),
    ],
)
def test_patterns_search_like_json_schema(
    byte_compiler: GrammarCompiler, schema: dict[str, Any], instance: Any
) -> None:
    assert _accepts(byte_compiler, schema, instance)


def test_full_match_pattern() -> None:
    assert full_match_pattern("^a+$") == "^a+$"
    assert full_match_pattern("^pkg:") == "(pkg:).*"
    assert full_match_pattern("abc") == ".*(abc).*"
    assert full_match_pattern("x\\$") == ".*(x\\$).*"
    assert full_match_pattern("") == ".*"


def test_pattern_properties_alone_refuse_other_keys(byte_compiler: GrammarCompiler) -> None:
    """Narrower than JSON Schema (which allows keys matching no pattern): reported too."""
    schema = {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}
    assert not _accepts(byte_compiler, schema, {"z": 1})
    assert unsupported_features(normalize(schema), strict=False) == (
        "patternProperties (keys matching no pattern are refused) at /",
    )
    assert unsupported_features(normalize(schema), strict=True) == ()


_ELSEWHERE = {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}, "required": ["a"]}


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
@pytest.mark.parametrize("reject_unsupported", [False, True])
def test_a_reference_to_another_document_is_refused_naming_it(
    byte_compiler: GrammarCompiler, backend: str, reject_unsupported: bool
) -> None:
    """This host fetches no schema: a `$ref` elsewhere is never compiled as "anything", even
    where unsupported keywords would only be listed."""
    with pytest.raises(UnsupportedSchema) as refused:
        byte_compiler.json_schema(_ELSEWHERE, backend=backend, reject_unsupported=reject_unsupported)
    if backend == "llguidance":  # its own words, naming the document
        assert "http://example.com/a.json" in str(refused.value)
    else:
        assert refused.value.features == ("$ref 'http://example.com/a.json' (outside the schema) at /properties/a",)
    relative = {"$ref": "defs.json#/a"}
    with pytest.raises(UnsupportedSchema, match=r"\$ref 'defs.json#/a' \(outside the schema\) at /"):
        byte_compiler.json_schema(relative, backend="xgrammar", reject_unsupported=reject_unsupported)


def test_a_tool_referring_to_another_document_is_refused(byte_compiler: GrammarCompiler) -> None:
    tools = [{"name": "f", "parameters": _ELSEWHERE}]
    with pytest.raises(
        UnsupportedSchema,
        match=r"\$ref 'http://example.com/a.json' \(outside the schema\) at /properties/a in tool 'f'",
    ):
        byte_compiler.tool_call(tools, choice="auto")
    with pytest.raises(UnsupportedSchema, match=r"http://example\.com/a\.json"):
        byte_compiler.tool_call(tools, choice="f")


def test_a_reference_to_an_id_inside_the_schema_goes_to_llguidance(byte_compiler: GrammarCompiler) -> None:
    schema = {
        "$defs": {"n": {"$id": "urn:n", "type": "integer"}},
        "type": "object",
        "properties": {"a": {"$ref": "urn:n"}},
    }
    grammar = byte_compiler.json_schema({**schema, "required": ["a"]})
    assert grammar.backend == "llguidance" and grammar.unsupported == ()
    good, bad = b'{"a":12}', b'{"a":"x"}'
    assert grammar.matcher().accept_tokens(list(good)) == len(good)
    assert grammar.matcher().accept_tokens(list(bad)) < len(bad)
