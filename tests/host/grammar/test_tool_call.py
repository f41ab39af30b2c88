"""Tool-call grammars: forced, required (one of several) and auto (text or tagged calls)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from host.grammar import GrammarCompiler, InvalidToolCall, token_table

from .conftest import BYTE_STOPS
from .walk import CLOSERS, walk

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
SEARCH = {
    "name": "search",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}
NO_ARGS = {"name": "now"}
TOOLS = [WEATHER, SEARCH, NO_ARGS]
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],  # type: ignore[index]
    "search": SEARCH["parameters"],
    "now": {"type": "object", "properties": {}, "additionalProperties": False},
}


def _accepts(compiler: GrammarCompiler, text: str, **options: str) -> bool:
    matcher = compiler.tool_call(TOOLS, **options).matcher()  # type: ignore[arg-type]
    data = list(text.encode())
    return matcher.accept_tokens(data) == len(data) and matcher.accept(BYTE_STOPS[0])


def _check_call(text: str) -> str:
    call = json.loads(text)
    assert list(call) == ["name", "arguments"]
    jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
    return str(call["name"])


@pytest.mark.parametrize("seed", range(8))
def test_forced_call_emits_the_named_function_with_valid_arguments(byte_compiler: GrammarCompiler, seed: int) -> None:
    grammar = byte_compiler.tool_call(TOOLS, choice="get_weather")
    tokens = walk(grammar.matcher(), random.Random(seed), prefer=CLOSERS)
    text = b"".join(token_table(byte_compiler.tokenizer)[t] for t in tokens[:-1]).decode()
    assert text.startswith('{"name":"get_weather","arguments":{"city":"')
    assert _check_call(text) == "get_weather"


@pytest.mark.parametrize("seed", range(8))
def test_required_call_picks_one_of_the_tools(byte_compiler: GrammarCompiler, seed: int) -> None:
    grammar = byte_compiler.tool_call(TOOLS, choice="required")
    tokens = walk(grammar.matcher(), random.Random(seed), prefer=CLOSERS)
    _check_call(b"".join(token_table(byte_compiler.tokenizer)[t] for t in tokens[:-1]).decode())


def test_required_and_forced_refuse_other_text(byte_compiler: GrammarCompiler) -> None:
    assert _accepts(byte_compiler, '{"name":"now","arguments":{}}', choice="required")
    assert _accepts(byte_compiler, '{"name":"search","arguments":{"q":"x"}}', choice="search")
    assert not _accepts(byte_compiler, '{"name":"now","arguments":{}}', choice="search")
    assert not _accepts(byte_compiler, '{"name":"search","arguments":{}}', choice="search"), "q is required"
    assert not _accepts(byte_compiler, "hello", choice="required")


def test_auto_allows_text_and_tagged_calls(byte_compiler: GrammarCompiler) -> None:
    call = '{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}'
    assert _accepts(byte_compiler, "Just text, no call.", choice="auto")
    assert _accepts(byte_compiler, f"Let me check. <tool_call>{call}</tool_call>", choice="auto")
    assert _accepts(byte_compiler, f"<tool_call>{call}</tool_call> done", choice="auto")
    bad_args = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    assert not _accepts(byte_compiler, f"<tool_call>{bad_args}</tool_call>", choice="auto")
    assert not _accepts(byte_compiler, '<tool_call>{"name":"other","arguments":{}}</tool_call>', choice="auto")
    assert not _accepts(byte_compiler, f"<tool_call>{call}", choice="auto"), "an open call must be closed"


def test_auto_honours_custom_markers(byte_compiler: GrammarCompiler) -> None:
    grammar = byte_compiler.tool_call([SEARCH], choice="auto", call_begin="[CALL]", call_end="[/CALL]")
    matcher = grammar.matcher()
    text = list(b'hi [CALL]{"name":"search","arguments":{"q":"x"}}[/CALL]')
    assert matcher.accept_tokens(text) == len(text) and matcher.accept(BYTE_STOPS[0])


@pytest.mark.parametrize(
    ("tools", "choice", "words"),
    [
        ([], "required", "non-empty list"),
        ("not json", "required", "not valid JSON"),
        ([{"description": "nameless"}], "required", "no function name"),
        ([{"name": "bad name!"}], "required", "must be 1-64"),
        ([SEARCH, SEARCH], "required", "unique"),
        ([{"name": "f", "parameters": []}], "required", "parameters must be a JSON schema"),
        ([SEARCH], "missing", "not among the tools"),
        ([{"name": "f", "parameters": {"type": "nope"}}], "f", 'Unsupported type "nope"'),
    ],
)
def test_bad_tool_lists_raise_typed_errors(
    byte_compiler: GrammarCompiler, tools: object, choice: str, words: str
) -> None:
    with pytest.raises(InvalidToolCall, match="invalid tool_call grammar") as info:
        byte_compiler.tool_call(tools, choice=choice)  # type: ignore[arg-type]
    assert words in str(info.value)
