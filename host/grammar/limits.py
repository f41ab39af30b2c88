"""The sizes past which a grammar is refused before it is compiled, and the checks: the grammar
text's length, a schema's nesting and its patterns' lengths, each refusal naming where.

Compile time grows fast with these sizes (measured with xgrammar 0.2.8: arrays nested 400 deep
took 2.4 s, 800 deep over a minute; a 1 MB regex about a minute), and a compile cannot be
interrupted: these keep one under a second. Knows no engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from host.grammar.errors import InvalidGrammar
from host.grammar.options import ERRORS

MAX_GRAMMAR_CHARS = {"regex": 16 * 1024, "ebnf": 256 * 1024, "json_schema": 1024 * 1024, "tool_call": 1024 * 1024}
MAX_PATTERN_CHARS = 16 * 1024  # a schema's `pattern` (and `patternProperties` keys)
MAX_SCHEMA_DEPTH = 128  # nesting of the schema document (objects and arrays)


def check_grammar_size(kind: str, text: str) -> None:
    """Refuse a grammar text of `kind` longer than MAX_GRAMMAR_CHARS allows."""
    limit = MAX_GRAMMAR_CHARS.get(kind)
    if limit is not None and len(text) > limit:
        raise ERRORS[kind](f"the grammar is {len(text)} characters, more than the {limit} this host compiles")


def check_schema_size(schema: Any, error: Callable[[str], InvalidGrammar]) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH or with a pattern longer than
    MAX_PATTERN_CHARS, naming where (iterative: a deep document must not exhaust the stack)."""
    stack: list[tuple[Any, str, int]] = [(schema, "", 1)]
    while stack:
        node, pointer, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise error(f"the schema nests deeper than the {MAX_SCHEMA_DEPTH} levels this host compiles (at {pointer})")
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{pointer}/{key}"
                if key == "pattern" and isinstance(value, str) and len(value) > MAX_PATTERN_CHARS:
                    raise error(
                        f"the pattern at {path} is longer than the {MAX_PATTERN_CHARS} characters this host compiles"
                    )
                if key == "patternProperties" and isinstance(value, dict):
                    for name in value:
                        if len(name) > MAX_PATTERN_CHARS:
                            raise error(
                                f"a patternProperties pattern at {path} is longer than {MAX_PATTERN_CHARS} characters"
                            )
                stack.append((value, path, depth + 1))
        elif isinstance(node, list):
            stack.extend((value, f"{pointer}/{i}", depth + 1) for i, value in enumerate(node))
