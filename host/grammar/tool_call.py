"""Tool-call grammars: a forced call of one named function, a required call of any of several,
or "auto" (free text in which calls may appear between begin/end markers).

A call is compact JSON, `{"name":"NAME","arguments":ARGS}`, ARGS following the function's
parameter schema. Builds xgrammar `Grammar` objects and structural tags; compiles nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import GrammarFormat, StructuralTag, TagFormat, TriggeredTagsFormat

from host.grammar.errors import InvalidToolCall

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_CALL_BEGIN = "<tool_call>"
DEFAULT_CALL_END = "</tool_call>"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]


def parse_tools(tools: Any) -> list[Tool]:
    """Tools as OpenAI's API sends them (`{"type": "function", "function": {...}}`) or bare
    (`{"name": ..., "parameters": ...}`); a JSON string of such a list is accepted too."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise InvalidToolCall(f"tools are not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidToolCall("tools nest too deep to parse") from None
    if not isinstance(tools, list) or not tools:
        raise InvalidToolCall("tools must be a non-empty list of functions")
    parsed: list[Tool] = []
    for i, entry in enumerate(tools):
        fn = entry.get("function", entry) if isinstance(entry, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidToolCall(f"tool {i} has no function name")
        name = fn["name"]
        if not _NAME.match(name):
            raise InvalidToolCall(f"tool name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidToolCall(f"tool {name!r}: parameters must be a JSON schema object")
        parsed.append(Tool(name, params))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise InvalidToolCall(f"tool names must be unique, got {names}")
    return parsed


def canonical_tools(tools: Sequence[Tool]) -> str:
    """The cache text for a tool list (order kept: it is part of the grammar)."""
    return json.dumps([{"name": t.name, "parameters": t.parameters} for t in tools], separators=(",", ":"))


def select(tools: Sequence[Tool], choice: str) -> list[Tool]:
    """The tools a choice may call: all for "auto"/"required", else the one named."""
    if choice in ("auto", "required"):
        return list(tools)
    for tool in tools:
        if tool.name == choice:
            return [tool]
    raise InvalidToolCall(f"tool_choice names {choice!r}, which is not among the tools {[t.name for t in tools]}")


def _call_prefix(name: str) -> str:
    return '{"name":' + json.dumps(name) + ',"arguments":'


def _literal(text: str) -> xgr.Grammar:
    # A JSON string literal is also a valid EBNF string literal (same escapes).
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def call_grammar(tool: Tool, arguments: xgr.Grammar) -> xgr.Grammar:
    return xgr.Grammar.concat(_literal(_call_prefix(tool.name)), arguments, _literal("}"))


def required_grammar(calls: Sequence[xgr.Grammar]) -> xgr.Grammar:
    return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)


def auto_structural_tag(
    tools: Sequence[Tool], arguments: Sequence[xgr.Grammar], call_begin: str, call_end: str
) -> StructuralTag:
    """Free text; each `call_begin` opens one call, which must be followed by `call_end`."""
    if not call_begin or not call_end:
        raise InvalidToolCall("auto tool calls need non-empty begin and end markers")
    tags = [
        TagFormat(
            begin=call_begin + _call_prefix(tool.name),
            content=GrammarFormat(grammar=str(args)),
            end="}" + call_end,
        )
        for tool, args in zip(tools, arguments, strict=True)
    ]
    return StructuralTag(format=TriggeredTagsFormat(triggers=[call_begin], tags=tags))
