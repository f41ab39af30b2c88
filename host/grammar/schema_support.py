"""What the grammar engines get of a JSON schema: older-draft spellings rewritten into the
forms xgrammar reads, formats no validator knows dropped (they are annotations), objects closed
for strict mode, and long maxLength bounds relaxed.

Pure functions on parsed JSON; knows the drafts and xgrammar 0.2.8's spellings, not how grammars
are compiled. xgrammar's gaps are schema_coverage's, exclusive oneOf schema_one_of's.
"""

from __future__ import annotations

from typing import Any

from host.grammar.schema_walk import map_subschemas

# jsonschema is imported where it is needed, not here: with its format checkers it takes over a
# second to import (rfc3987-syntax builds a parser), which a CLI run pays for every grammar.


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
