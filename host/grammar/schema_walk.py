"""Where a JSON schema keeps its subschemas: the keywords that hold them, the walk over them with
JSON pointers, a copy with each replaced, and local `$ref`s followed.

Pure functions on parsed JSON; knows JSON Schema's structure, not what any engine enforces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

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


def map_subschemas(node: dict[str, Any], pointer: str, fn: Callable[[Any, str, str], Any]) -> dict[str, Any]:
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
