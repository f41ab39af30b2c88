"""What the grammar engines do with a JSON schema: older-draft spellings rewritten into the
forms xgrammar reads, formats no validator knows dropped (they are annotations), the keywords
xgrammar compiles without enforcing found by JSON pointer, and objects closed for strict mode.

Pure functions on parsed JSON; knows xgrammar 0.2.8's coverage (measured in
tests/host/grammar/test_schema_support.py), not how grammars are compiled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

# jsonschema is imported where it is needed, not here: with its format checkers it takes over a
# second to import (rfc3987-syntax builds a parser), which a CLI run pays for every grammar.

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
    return map_subschemas(out, "", lambda sub, _key, _pointer: normalize(sub))


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


def draft_validator(schema: Any) -> Any:
    """The jsonschema validator class of the draft `schema` declares (2020-12 when none)."""
    from jsonschema import Draft202012Validator, validators

    return (
        validators.validator_for(schema, default=Draft202012Validator)
        if isinstance(schema, dict)
        else Draft202012Validator
    )


def refs_ignore_siblings(schema: Any) -> bool:
    """Drafts 4-7: keywords beside `$ref` are ignored (by the standard, so by a validator too)."""
    if not (isinstance(schema, dict) and "$schema" in schema):
        return False  # 2020-12, without asking jsonschema
    return draft_validator(schema).__name__ in (
        "Draft3Validator",
        "Draft4Validator",
        "Draft6Validator",
        "Draft7Validator",
    )


def drop_annotation_formats(schema: Any, known: frozenset[str]) -> tuple[Any, tuple[str, ...]]:
    """`schema` without the `format` values its draft's format checker does not know (`known`):
    JSON Schema reads those as annotations that never fail validation. Returns where they were."""
    found: list[str] = []

    def drop(node: Any, _key: str, pointer: str) -> Any:
        if not isinstance(node, dict):
            return node
        out = map_subschemas(node, pointer, drop)
        if isinstance(out.get("format"), str) and out["format"] not in known:
            found.append(f"format {out.pop('format')!r} at {pointer or '/'}")
        return out

    return drop(schema, "", ""), tuple(found)


def checked_formats(schema: Any) -> frozenset[str]:
    """Formats a validator may check in `schema`: those of its draft's format checker and of the
    newest draft's (a validator may well check `date` in a draft-04 schema, so it is enforced,
    never dropped). jsonschema with its format-nongpl extras, as this package installs it."""
    from jsonschema import Draft202012Validator

    newest = Draft202012Validator.FORMAT_CHECKER.checkers
    return frozenset(draft_validator(schema).FORMAT_CHECKER.checkers) | frozenset(newest)


def has_format(schema: Any) -> bool:
    """Whether any subschema of `schema` has a string `format`."""
    if isinstance(schema, dict):
        return isinstance(schema.get("format"), str) or any(has_format(v) for v in schema.values())
    if isinstance(schema, list):
        return any(has_format(v) for v in schema)
    return False


def map_subschemas(node: dict[str, Any], pointer: str, fn: Any) -> dict[str, Any]:
    """A copy of `node` with each direct subschema replaced by fn(subschema, keyword, pointer)."""
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key], key, f"{pointer}/{key}")
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {n: fn(sub, key, f"{pointer}/{key}/{_escape(str(n))}") for n, sub in out[key].items()}
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [fn(sub, key, f"{pointer}/{key}/{i}") for i, sub in enumerate(out[key])]
    return out


def close_objects(schema: Any) -> Any:
    """`schema` with OpenAI's strict mode made explicit (as xgrammar's strict mode reads it): an
    object that declares `properties` and says nothing of other properties gets
    `additionalProperties: false` (a bare `type: object` stays any object), a tuple without `items` gets
    `items: false`. allOf members are left open (closing each would refuse the properties its
    siblings declare); their parent is closed when it declares properties itself."""

    def close(node: Any, keyword: str, pointer: str) -> Any:
        if not isinstance(node, dict):
            return node
        out = map_subschemas(node, pointer, close)
        if keyword != "allOf":
            if "properties" in out and not any(
                k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
            ):
                out["additionalProperties"] = False
            if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
                out["items"] = False
        return out

    return close(schema, "", "")


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
    for key in _IGNORED:
        if key in node:
            yield key
    if node.get("uniqueItems") is True:
        yield "uniqueItems"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        yield "allOf (more than one subschema)"
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 and not _exclusive(root, node["oneOf"]):
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
    from jsonschema import Draft202012Validator

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


def relax_max_length(schema: Any, limit: int, pointer: str = "") -> tuple[Any, tuple[str, ...]]:
    """`schema` without the maxLength bounds above `limit`, and where they were.

    xgrammar unrolls a bounded string into states per character: measured with SmolLM2, compiling
    one maxLength costs 0.2 s at 16, 1.2 s at 64 and 3-4 s from 256 on (each distinct bound).
    """
    found: list[str] = []

    def relax(node: Any, _key: str, pointer: str) -> Any:
        if not isinstance(node, dict):
            return node
        out = map_subschemas(node, pointer, relax)
        bound = out.get("maxLength")
        if isinstance(bound, int) and not isinstance(bound, bool) and bound > limit:
            del out["maxLength"]
            found.append(f"maxLength above {limit} at {pointer or '/'}")
        return out

    return relax(schema, "", pointer), tuple(found)


_JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string"})


def exclusive_one_of_as_any_of(schema: Any) -> Any:
    """`schema` with each `oneOf` whose branches provably never match the same value rewritten
    as `anyOf` (then the same thing, and both engines enforce anyOf). Proofs: the branches'
    JSON types are disjoint, or, where both can be objects, a property both require has
    disjoint const/enum values (a discriminator). Anything unproven stays oneOf."""
    root = schema

    def rewrite(node: Any, _key: str, pointer: str) -> Any:
        if not isinstance(node, dict):
            return node
        out = map_subschemas(node, pointer, rewrite)
        branches = out.get("oneOf")
        if isinstance(branches, list) and len(branches) > 1 and "anyOf" not in out:
            if _exclusive(root, branches):
                out["anyOf"] = out.pop("oneOf")
        return out

    return rewrite(schema, "", "")


def _exclusive(root: Any, branches: list[Any]) -> bool:
    return all(_disjoint(root, a, b) for i, a in enumerate(branches) for b in branches[i + 1 :])


def resolve_local_ref(root: Any, node: Any, max_depth: int = 8) -> Any:
    """`node` with local `$ref`s ("#/a/b") followed, up to `max_depth` of them; a ref that
    points nowhere, or elsewhere, is left as it is."""
    depth = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < max_depth:
        ref = node["$ref"]
        if not ref.startswith("#"):
            return node
        target: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return node
        node, depth = target, depth + 1
    return node


def _value_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _types(root: Any, node: Any, depth: int = 0) -> frozenset[str]:
    """The JSON types a value matching `node` can have (integer counts as number)."""
    node = resolve_local_ref(root, node)
    if node is False:
        return frozenset()
    if not isinstance(node, dict) or depth > 8:
        return _JSON_TYPES
    found = _JSON_TYPES
    declared = node.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list):
        found = frozenset("number" if t == "integer" else str(t) for t in declared) & _JSON_TYPES
    values = _values(root, node)
    if values is not None:
        found &= frozenset(_value_type(v) for v in values)
    if isinstance(node.get("anyOf"), list):
        found &= frozenset().union(*(_types(root, b, depth + 1) for b in node["anyOf"]))
    return found


def _values(root: Any, node: Any) -> list[Any] | None:
    """The values `node` allows when it lists them (const or enum), else None."""
    node = resolve_local_ref(root, node)
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    if isinstance(node.get("enum"), list):
        return list(node["enum"])
    return None


def _disjoint(root: Any, a: Any, b: Any) -> bool:
    a, b = resolve_local_ref(root, a), resolve_local_ref(root, b)
    shared = _types(root, a) & _types(root, b)
    if not shared:
        return True
    if shared != {"object"} or not isinstance(a, dict) or not isinstance(b, dict):
        return False
    return any(_discriminates(root, a, b, name) for name in _required(a) & _required(b))


def _required(node: dict[str, Any]) -> set[str]:
    required = node.get("required")
    return {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()


def _discriminates(root: Any, a: dict[str, Any], b: dict[str, Any], name: str) -> bool:
    values = []
    for node in (a, b):
        props = node.get("properties")
        found = _values(root, props.get(name)) if isinstance(props, dict) else None
        if found is None:
            return False
        values.append([json.dumps(v, sort_keys=True) for v in found])
    return not set(values[0]) & set(values[1])
