"""tools and tool_choice on the dummy driver with the real openai client: a forced or required
call comes back as tool_calls whose JSON-string arguments follow the function's schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.host.daemon.conftest import Server

FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMAS = {"forecast": FORECAST, "set_alarm": ALARM}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_tool_choice_is_called_with_valid_arguments(server: Server) -> None:
    client = server.client()
    for seed in range(3):
        resp = client.chat.completions.create(
            model="dummy",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "forecast"}},
            max_tokens=80,
            seed=seed,
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls or [], {"forecast"})


def test_required_calls_one_of_the_tools(server: Server) -> None:
    client = server.client()
    resp = client.chat.completions.create(
        model="dummy", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, seed=5
    )
    assert resp.choices[0].finish_reason == "tool_calls"
    _check_calls(resp.choices[0].message.tool_calls or [], {"forecast", "set_alarm"})


def test_streamed_tool_calls_arrive_whole(server: Server) -> None:
    client = server.client()
    stream = client.chat.completions.create(
        model="dummy",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_alarm"}},
        max_tokens=80,
        seed=2,
        stream=True,
    )
    calls: list[Any] = []
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert len(calls) == 1 and calls[0].function.name == "set_alarm"
    jsonschema.validate(json.loads(calls[0].function.arguments or ""), ALARM)


def test_tool_choice_none_answers_in_text(server: Server) -> None:
    resp = server.client().chat.completions.create(
        model="dummy", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, seed=1
    )
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason in ("stop", "length")


def test_auto_gives_text_or_well_formed_calls(server: Server) -> None:
    client = server.client()
    for seed in range(3):
        resp = client.chat.completions.create(model="dummy", messages=MESSAGES, tools=TOOLS, max_tokens=60, seed=seed)
        choice = resp.choices[0]
        if choice.finish_reason == "tool_calls":
            _check_calls(choice.message.tool_calls or [], {"forecast", "set_alarm"})
        else:
            assert choice.message.tool_calls is None and choice.message.content is not None


def test_the_renderer_knows_the_grammar_markers() -> None:
    from host.daemon.openai_render import CALL_BEGIN, CALL_END
    from host.grammar.tool_call import DEFAULT_CALL_BEGIN, DEFAULT_CALL_END

    assert (CALL_BEGIN, CALL_END) == (DEFAULT_CALL_BEGIN, DEFAULT_CALL_END)


def test_a_forced_call_cut_by_max_tokens_is_still_a_call(server: Server) -> None:
    """The arguments as far as they were generated, with finish_reason "length" (as vLLM and
    OpenAI return them), not the raw call JSON in content."""
    client = server.client()
    prefix = '{"name":"forecast","arguments":'
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(
            model="dummy",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "forecast"}},
            max_tokens=len(prefix) + 6,  # the dummy's tokens are bytes: cut inside the arguments
            seed=3,
        )
        if stream:
            calls: list[Any] = []
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    calls += choice.delta.tool_calls or []
                    finish = choice.finish_reason or finish
            name, arguments = calls[0].function.name, calls[0].function.arguments or ""
        else:
            resp = client.chat.completions.create(**kwargs)
            finish, message = resp.choices[0].finish_reason, resp.choices[0].message
            assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
            name, arguments = message.tool_calls[0].function.name, message.tool_calls[0].function.arguments
        assert finish == "length" and name == "forecast"
        assert arguments.startswith("{") and 0 < len(arguments) <= 6, arguments  # JSON cut short


def test_an_empty_tool_list_is_refused(server: Server) -> None:
    """`tools: []` is a mistake rather than "no tools": a 400 naming the field."""
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model="dummy", messages=MESSAGES, tools=[], max_tokens=8)
    assert info.value.status_code == 400 and "tools must name at least one function" in info.value.message
    body = info.value.body if isinstance(info.value.body, dict) else {}
    assert body.get("param") == "tools"
