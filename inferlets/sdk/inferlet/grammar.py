"""Grammars for constrained decoding. The grammar and its parse state live on the host; a
decode step names the matcher, the host masks the step's logits from it, and the SDK feeds the
sampled token back. Compiled grammars are cached on the host, so compiling twice is cheap."""

from __future__ import annotations

import json
from typing import Any

from componentize_py_types import Err
from wit_world.imports import grammar as _g

from inferlet.checks import need


class GrammarError(Exception):
    """The host could not compile the grammar (the message names the problem)."""


class Grammar:
    """A compiled grammar. Build one with the static constructors."""

    def __init__(self, kind: str, text: str = "", **options: Any) -> None:
        try:
            self._handle = _g.Grammar.compile(kind, text, json.dumps(options) if options else "")
        except Err as e:
            raise GrammarError(str(e.value)) from None

    @staticmethod
    def json_object(compact: bool = True) -> Grammar:
        """Any JSON object."""
        return Grammar("json-object", compact=compact)

    @staticmethod
    def json_schema(schema: str | dict[str, Any], strict: bool = True, compact: bool = True, **options: Any) -> Grammar:
        """JSON valid against `schema` (properties in the schema's order). Other options as the
        host's compiler takes them: `reject_unsupported`, `max_length_limit`, `backend`
        ("auto", "xgrammar" or "llguidance"); see docs/grammar.md."""
        need(schema, (str, dict), "Grammar.json_schema()'s schema")
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return Grammar("json-schema", text, strict=strict, compact=compact, **options)

    @staticmethod
    def regex(pattern: str) -> Grammar:
        need(pattern, str, "Grammar.regex()'s pattern")
        return Grammar("regex", pattern)

    @staticmethod
    def ebnf(text: str, root: str = "root") -> Grammar:
        need(text, str, "Grammar.ebnf()'s text")
        need(root, str, "Grammar.ebnf()'s root")
        return Grammar("ebnf", text, root=root)

    @staticmethod
    def tool_call(tools: list[dict[str, Any]], choice: str = "required") -> Grammar:
        """A call of one of `tools` (OpenAI function format): `choice` is a tool name,
        "required" (some tool) or "auto" (text, or calls between markers)."""
        need(tools, list, "Grammar.tool_call()'s tools")
        need(choice, str, "Grammar.tool_call()'s choice")
        return Grammar("tool-call", json.dumps(tools), choice=choice)

    @property
    def unsupported(self) -> list[str]:
        """Schema keywords compiled but not enforced ("keyword at /pointer")."""
        return list(self._handle.unsupported())

    def matcher(self) -> Matcher:
        return Matcher(_g.Matcher(self._handle))


class Matcher:
    """One generation's position in a grammar."""

    def __init__(self, handle: _g.Matcher) -> None:
        self._handle = handle
        self.id: int = handle.id()

    def accept(self, token: int) -> bool:
        return bool(self._handle.accept(token))

    def rollback(self, n: int) -> None:
        try:
            self._handle.rollback(n)
        except Err as e:
            raise GrammarError(str(e.value)) from None

    def is_terminated(self) -> bool:
        return bool(self._handle.is_terminated())

    def reset(self) -> None:
        self._handle.reset()

    def fork(self) -> Matcher:
        """An independent copy of this matcher's state."""
        return Matcher(self._handle.fork())

    def release(self) -> None:
        """Free the host-side state now (otherwise at the end of the run)."""
        self._handle.__exit__(None, None, None)
