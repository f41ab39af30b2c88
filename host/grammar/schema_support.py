"""What the grammar engine does with a JSON schema: older-draft spellings rewritten into the
forms xgrammar reads, and the keywords it compiles without enforcing, found by JSON pointer.

Pure functions on parsed JSON; knows xgrammar 0.2.8's coverage (measured in
tests/host/grammar/test_schema_support.py), not how grammars are compiled.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
        "relative-json-pointer",
    }
)

# Keywords whose value is one subschema, a map of subschemas, or a list of subschemas.
_ONE = (
    "additionalProperties",
    "additionalItems",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")

# Keywords xgrammar parses past without constraining the output at all.
_IGNORED = (
    "not",
    "if",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "minContains",
    "maxContains",
)


def subschemas(schema: dict[str, Any], pointer: str) -> Iterator[tuple[dict[str, Any], str]]:
    """The schema objects directly inside `schema`, with their JSON pointers."""
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield schema[key], f"{pointer}/{key}"
    for key in _MAP:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if isinstance(sub, dict):
                    yield sub, f"{pointer}/{key}/{_escape(str(name))}"
    for key in _LIST:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if isinstance(sub, dict):
                    yield sub, f"{pointer}/{key}/{i}"


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def normalize(schema: Any) -> Any:
    """A copy of `schema` with draft-04..07 spellings that xgrammar rejects rewritten:
    boolean exclusiveMinimum/Maximum, and `items` as a list (tuple validation) with
    `additionalItems`; minItems without items gets `items: {}` (the same meaning); patterns
    become full-match patterns. Other values are returned as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), bool):
            if out.pop(bound) and isinstance(out.get(limit), int | float):
                out[bound] = out.pop(limit)
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    elif "additionalItems" in out:
        del out["additionalItems"]  # ignored by every draft when items is not a list
    if "minItems" in out and "items" not in out and "prefixItems" not in out:
        out["items"] = {}  # strict mode otherwise reads "no items declared" as "no items allowed"
    if isinstance(out.get("pattern"), str):
        out["pattern"] = full_match_pattern(out["pattern"])
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {full_match_pattern(k): v for k, v in out["patternProperties"].items()}
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = normalize(out[key])
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: normalize(sub) for name, sub in out[key].items()}
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [normalize(sub) for sub in out[key]]
    return out


def full_match_pattern(pattern: str) -> str:
    """A JSON Schema pattern (a search: "^pkg:" matches "pkg:x") as the full-match regex that
    xgrammar reads it as ("pkg:" alone otherwise)."""
    starts = pattern.startswith("^")
    ends = pattern.endswith("$") and not pattern.endswith("\\$")
    if starts and ends:
        return pattern
    core = pattern[1 if starts else 0 : len(pattern) - 1 if ends else len(pattern)]
    if not core:
        return ".*"
    return ("" if starts else ".*") + "(" + core + ")" + ("" if ends else ".*")


def unsupported_features(schema: Any, strict: bool) -> tuple[str, ...]:
    """Keywords of a (normalized) schema that the compiled grammar does not follow exactly
    (most are not enforced; a few refuse more than JSON Schema would), as
    "keyword at /pointer" (pointer "/" is the root). With `strict`, undeclared properties are
    refused anyway, so keywords about them are not listed."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        if not isinstance(node, dict):
            continue
        found.extend(f"{word} at {pointer or '/'}" for word in _node_features(node, strict))
        stack.extend(subschemas(node, pointer))
    return tuple(sorted(found))


def _node_features(node: dict[str, Any], strict: bool) -> Iterator[str]:
    for key in _IGNORED:
        if key in node:
            yield key
    if node.get("uniqueItems") is True:
        yield "uniqueItems"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        yield "allOf (more than one subschema)"
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1:
        yield "oneOf (matched as anyOf)"
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


def _enforced_multiple_of(node: dict[str, Any]) -> bool:
    """xgrammar checks multipleOf only for an integer type with an integer step and no bounds."""
    bounded = any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
    step = node["multipleOf"]
    return node.get("type") == "integer" and isinstance(step, int) and not isinstance(step, bool) and not bounded


def relax_max_length(schema: Any, limit: int, pointer: str = "") -> tuple[Any, tuple[str, ...]]:
    """`schema` without the maxLength bounds above `limit`, and where they were.

    xgrammar unrolls a bounded string into states per character: measured with SmolLM2, compiling
    one maxLength costs 0.2 s at 16, 1.2 s at 64 and 3-4 s from 256 on (each distinct bound).
    """
    if not isinstance(schema, dict):
        return schema, ()
    out = dict(schema)
    found: list[str] = []
    bound = out.get("maxLength")
    if isinstance(bound, int) and not isinstance(bound, bool) and bound > limit:
        del out["maxLength"]
        found.append(f"maxLength above {limit} at {pointer or '/'}")
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key], sub = relax_max_length(out[key], limit, f"{pointer}/{key}")
            found += sub
    for key in _MAP:
        if isinstance(out.get(key), dict):
            relaxed = {}
            for name, value in out[key].items():
                relaxed[name], sub = relax_max_length(value, limit, f"{pointer}/{key}/{_escape(str(name))}")
                found += sub
            out[key] = relaxed
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(out.get(key), list):
            items = []
            for i, value in enumerate(out[key]):
                relaxed_item, sub = relax_max_length(value, limit, f"{pointer}/{key}/{i}")
                items.append(relaxed_item)
                found += sub
            out[key] = items
    return out, tuple(found)
