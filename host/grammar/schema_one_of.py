"""Which `oneOf`s are exclusive: proofs that no value matches two branches (disjoint JSON types,
or a discriminator property with disjoint const/enum values), and those rewritten as `anyOf`.

Pure functions on parsed JSON; anything unproven stays oneOf. Knows no engine.
"""

from __future__ import annotations

import json
from typing import Any

from host.grammar.schema_walk import map_subschemas, resolve_local_ref

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
            if is_exclusive(root, branches):
                out["anyOf"] = out.pop("oneOf")
        return out

    return rewrite(schema, "", "")


def is_exclusive(root: Any, branches: list[Any]) -> bool:
    """Whether no value can match two of `branches` (subschemas of the document `root`)."""
    return all(_disjoint(root, a, b) for i, a in enumerate(branches) for b in branches[i + 1 :])


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
