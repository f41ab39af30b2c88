"""xgrammar 0.2.8's gaps in a JSON schema: the keywords it compiles without enforcing exactly,
found by JSON pointer ("keyword at /pointer"), so a caller can warn, refuse, or pick llguidance.

Pure functions on parsed JSON; the coverage is measured in tests/host/grammar/test_schema_support.py.
Knows what xgrammar enforces, not how a grammar is compiled.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from host.grammar.schema_one_of import is_exclusive
from host.grammar.schema_support import refs_ignore_siblings
from host.grammar.schema_walk import subschemas

# Formats xgrammar turns into a string grammar; any other format is accepted as a plain string.
KNOWN_FORMATS = frozenset(
    {
        "date",
        "date-time",
        "time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
    }
)

# Keywords that constrain one type only, which xgrammar drops from a node without `type` (it
# then allows any JSON there): measured, e.g. {"minLength": 3} accepted "ab" and 7.
_TYPED_KEYWORDS = (
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minProperties",
    "maxProperties",
    "maxItems",
)
# Keywords that never constrain a value (annotations, identifiers, definitions).
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "example",
        "$comment",
        "$id",
        "id",
        "$schema",
        "$anchor",
        "$dynamicAnchor",
        "$defs",
        "definitions",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
        "nullable",
    }
)
# Keywords xgrammar compiles a node from while ignoring every other keyword beside them.
_EXCLUSIVE = ("anyOf", "oneOf", "enum", "const", "$ref")

# Keywords xgrammar parses past without constraining the output at all.
_IGNORED = (
    "not",
    "$dynamicRef",
    "$recursiveRef",
    "if",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "minContains",
    "maxContains",
)


# How a `$ref` to another document is listed: neither engine has that document (this host fetches
# nothing; llguidance resolves only a `$id` inside the schema), so such a schema is never compiled
# with it unenforced (host.grammar.builder refuses it whatever `reject_unsupported` says).
OUTSIDE_REF = "outside the schema"


def unsupported_features(schema: Any, strict: bool) -> tuple[str, ...]:
    """Keywords of a (normalized) schema that the compiled grammar does not follow exactly
    (most are not enforced; a few refuse more than JSON Schema would), as
    "keyword at /pointer" (pointer "/" is the root). With `strict`, undeclared properties are
    refused anyway, so keywords about them are not listed."""
    found: list[str] = []
    ref_siblings_ignored = refs_ignore_siblings(schema)
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict):
            continue
        # A propertyNames schema applies to keys, which are strings whether it says so or not.
        key_schema = pointer.endswith("/propertyNames")
        features = _node_features(schema, node, strict, ref_siblings_ignored, key_schema)
        found.extend(f"{word} at {pointer or '/'}" for word in features)
        stack.extend(subschemas(node, pointer))
    return tuple(sorted(found))


def _node_features(
    root: Any, node: dict[str, Any], strict: bool, ref_siblings_ignored: bool, key_schema: bool
) -> Iterator[str]:
    if "type" not in node and not key_schema and not ("$ref" in node and ref_siblings_ignored):
        for key in _TYPED_KEYWORDS:
            if key in node:
                yield f"{key} without type"
    yield from _ignored_siblings(node, ref_siblings_ignored)
    ref = node.get("$ref")
    # xgrammar follows "#" and "#/pointer" only; any other reference compiled as any JSON.
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        yield f"$ref {ref!r} ({'an anchor' if ref.startswith('#') else OUTSIDE_REF})"
    for key in _IGNORED:
        if key in node:
            yield key
    if node.get("uniqueItems") is True:
        yield "uniqueItems"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        yield "allOf (more than one subschema)"
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 and not is_exclusive(root, node["oneOf"]):
        yield "oneOf (matched as anyOf)"
    for shape in ("format", "pattern"):  # measured: xgrammar compiles the shape alone
        if isinstance(node.get(shape), str):
            for bound in ("minLength", "maxLength"):
                if bound in node:
                    yield f"{bound} beside {shape}"
    if "multipleOf" in node and not _enforced_multiple_of(node):
        yield "multipleOf (only on integers without bounds)"
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in KNOWN_FORMATS and node.get("type", "string") == "string":
        yield f"format {fmt!r}"
    if not strict:
        for key in ("unevaluatedProperties", "unevaluatedItems"):
            if key in node:
                yield key
        if isinstance(node.get("patternProperties"), dict):
            if "properties" in node:
                yield "patternProperties (ignored beside properties unless strict)"
            elif node.get("additionalProperties", True) is not False:
                yield "patternProperties (keys matching no pattern are refused)"
    declared = node.get("properties")
    required = node.get("required")
    if isinstance(required, list) and any(name not in (declared or {}) for name in required):
        yield "required (a name not in properties)"


def outside_refs(features: tuple[str, ...]) -> tuple[str, ...]:
    """The `$ref`s to other documents among `features` (of `unsupported_features`)."""
    return tuple(f for f in features if f.startswith("$ref ") and f"({OUTSIDE_REF})" in f)


def _ignored_siblings(node: dict[str, Any], ref_siblings_ignored: bool) -> Iterator[str]:
    """Keywords beside anyOf/oneOf/enum/const/$ref, which xgrammar compiles alone. Beside an
    enum or const they are harmless when every allowed value satisfies them anyway."""
    exclusive = [k for k in _EXCLUSIVE if k in node and not (k == "$ref" and ref_siblings_ignored)]
    if not exclusive:
        return
    first = exclusive[0]
    others = sorted(k for k in node if k != first and k not in _ANNOTATIONS and not k.startswith("x-"))
    if ref_siblings_ignored and "$ref" in others:
        others.remove("$ref")
    if not others:
        return
    if first in ("enum", "const") and _values_satisfy(node, first):
        return
    yield f"{first} with other keywords beside it ({' '.join(others)})"


def _values_satisfy(node: dict[str, Any], keyword: str) -> bool:
    values = node[keyword] if keyword == "enum" else [node[keyword]]
    rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
    if not isinstance(values, list) or any("$ref" in str(k) for k in rest):
        return False
    from jsonschema import Draft202012Validator  # here: slow to import (see schema_support)

    try:
        validator = Draft202012Validator(rest)
        return all(validator.is_valid(value) for value in values)
    except Exception:  # a sibling the validator cannot read (a $ref inside, say): keep the warning
        return False


def _enforced_multiple_of(node: dict[str, Any]) -> bool:
    """xgrammar checks multipleOf only for an integer type with an integer step and no bounds."""
    bounded = any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
    step = node["multipleOf"]
    return node.get("type") == "integer" and isinstance(step, int) and not isinstance(step, bool) and not bounded
