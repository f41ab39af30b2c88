"""Test helper: put an instance's object keys in the order a grammar for its schema emits them.

xgrammar fixes the order of declared properties (the schema's `properties` order, then any
others), as a model's output under the grammar would have it; an instance written in another
order is valid JSON Schema but not a sentence of the grammar. Follows local $refs, allOf
(merged), anyOf/oneOf (the branch declaring most of the instance's keys), items and prefixItems.
"""

from __future__ import annotations

import re
from typing import Any

from host.grammar.schema_walk import resolve_local_ref


def _resolve(root: Any, node: Any) -> Any:
    node = resolve_local_ref(root, node, max_depth=50)
    unresolved = isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#")
    return node if isinstance(node, dict) and not unresolved else {}


def _properties(root: Any, node: dict[str, Any], instance: dict[str, Any]) -> dict[str, Any]:
    """Declared properties in emission order, merged over allOf and the best anyOf/oneOf branch."""
    props: dict[str, Any] = {}
    if isinstance(node.get("properties"), dict):
        props.update(node["properties"])
    for sub in node.get("allOf") or ():
        for name, value in _properties(root, _resolve(root, sub), instance).items():
            props.setdefault(name, value)
    branches = [_resolve(root, b) for b in (node.get("anyOf") or node.get("oneOf") or ())]
    if branches:
        best = max(branches, key=lambda b: len(set(_properties(root, b, instance)) & set(instance)))
        for name, value in _properties(root, best, instance).items():
            props.setdefault(name, value)
    return props


def in_schema_order(root: Any, node: Any, instance: Any) -> Any:
    node = _resolve(root, node)
    if isinstance(instance, list):
        prefix = node.get("prefixItems") or (node["items"] if isinstance(node.get("items"), list) else [])
        rest = node.get("items") if isinstance(node.get("items"), dict) else {}
        return [in_schema_order(root, prefix[i] if i < len(prefix) else rest, v) for i, v in enumerate(instance)]
    if not isinstance(instance, dict):
        return instance
    props = _properties(root, node, instance)
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    extra = node.get("additionalProperties") if isinstance(node.get("additionalProperties"), dict) else {}
    ordered = [k for k in props if k in instance] + [k for k in instance if k not in props]
    out: dict[str, Any] = {}
    for key in ordered:
        sub = props.get(key)
        if sub is None:
            sub = next((s for p, s in patterns.items() if re.search(p, key)), extra)
        out[key] = in_schema_order(root, sub, instance[key])
    return out
