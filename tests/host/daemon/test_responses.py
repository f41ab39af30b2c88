"""`POST /v1/responses` with the real openai client against the daemon on the dummy driver: the
same chat path as chat completions (greedy outputs and prompt token counts agree with the
equivalent chat request), typed stream events, function tools, structured output, stored
responses per key, and errors."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from host.daemon.call_stream import CallArguments
from host.daemon.responses_store import ResponseStore
from tests.host.daemon.conftest import OTHER_KEY, Server
from tests.host.daemon.test_structured import SCHEMA as WEATHER
from tests.host.daemon.test_tools import FORECAST

TOOL: Any = {"type": "function", "name": "forecast", "description": "The weather", "parameters": FORECAST}


def respond(server: Server, key: str | None = None, **kwargs: Any) -> Any:
    params: dict[str, Any] = {"model": "dummy", "input": "Say something.", "max_output_tokens": 12, "temperature": 0}
    params.update(kwargs)
    client = server.client(key) if key else server.client()
    return client.responses.create(**params)


def chat(server: Server, messages: list[Any], **kwargs: Any) -> Any:
    params: dict[str, Any] = {"model": "dummy", "messages": messages, "max_tokens": 12, "temperature": 0}
    params.update(kwargs)
    return server.client().chat.completions.create(**params)


def test_a_plain_response_is_the_chat_answer(server: Server) -> None:
    resp = respond(server, instructions="Be brief.")
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "dummy"
    assert resp.status in ("completed", "incomplete")
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    answer = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}])
    assert resp.output_text == answer.choices[0].message.content
    assert resp.usage.input_tokens == answer.usage.prompt_tokens
    assert resp.usage.output_tokens == answer.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if answer.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.store is False  # store is false unless asked


def test_input_items_are_messages(server: Server) -> None:
    items: Any = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say something."}]},
    ]
    resp = respond(server, input=items)
    answer = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}])
    assert resp.output_text == answer.choices[0].message.content


def test_the_stream_has_the_typed_events_and_the_same_text(server: Server) -> None:
    whole = respond(server, max_output_tokens=40)
    events = list(respond(server, max_output_tokens=40, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.output_text == text and done.usage == whole.usage and done.id == events[0].response.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {done.output[0].id}


def test_a_function_tool_is_called_with_valid_arguments(server: Server) -> None:
    for seed in range(3):
        resp = respond(
            server,
            tools=[TOOL],
            tool_choice={"type": "function", "name": "forecast"},
            max_output_tokens=80,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        assert resp.status == "completed"
        (call,) = resp.output
        assert call.type == "function_call" and call.name == "forecast" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), FORECAST)


def test_a_streamed_function_call_has_argument_events(server: Server) -> None:
    """A forced call's arguments stream as they are generated; their deltas add up to the
    arguments of the done event, of the final response and of the same request unstreamed."""
    kwargs: Any = {"tools": [TOOL], "tool_choice": "required", "max_output_tokens": 80, "extra_body": {"seed": 4}}
    events = list(respond(server, stream=True, temperature=1.0, **kwargs))
    kinds = [e.type for e in events]
    num_deltas = kinds.count("response.function_call_arguments.delta")
    assert num_deltas > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.type == "function_call" and events[2].item.name == "forecast"
    assert events[2].item.arguments == ""
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert events[-3].arguments == arguments and events[-3].item_id == events[2].item.id
    jsonschema.validate(json.loads(arguments), FORECAST)
    assert events[-1].response.output[0].arguments == arguments
    same = respond(server, temperature=1.0, **kwargs)
    assert same.output[0].arguments == arguments  # streamed or not, one call


def test_a_forced_call_cut_by_max_output_tokens(server: Server) -> None:
    """Its arguments as far as they were generated, status incomplete, streamed or not."""
    prefix = '{"name":"forecast","arguments":'
    kwargs: Any = {"tools": [TOOL], "tool_choice": "required", "extra_body": {"seed": 3}}
    kwargs["max_output_tokens"] = len(prefix) + 6  # the dummy's tokens are bytes: cut inside the arguments
    whole = respond(server, temperature=1.0, **kwargs)
    (call,) = whole.output
    assert whole.status == "incomplete" and call.type == "function_call" and call.status == "incomplete"
    assert call.arguments.startswith("{") and 0 < len(call.arguments) <= 6
    events = list(respond(server, temperature=1.0, stream=True, **kwargs))
    assert events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments


def test_call_arguments_hold_back_what_may_close_the_call() -> None:
    stream = CallArguments()
    assert stream.advance('{"name":"f', None) == "" and stream.name is None
    assert stream.advance('{"name":"f","arguments":{"a"', None) == '{"a'  # the last `"` may end the call
    assert stream.advance('{"name":"f","arguments":{"a":1}', None) == '":1'
    assert stream.advance('{"name":"f","arguments":{"a":1}}', "stop") == "}" and stream.text == '{"a":1}'
    cut = CallArguments()
    assert cut.advance('{"name":"f","arguments":{"a":', "length") == '{"a":' and cut.name == "f"


def test_a_json_schema_response_parses_and_validates(server: Server) -> None:
    fmt: Any = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    for seed in range(3):
        resp = respond(server, text=fmt, max_output_tokens=120, temperature=1.0, extra_body={"seed": seed})
        assert resp.status == "completed", resp
        jsonschema.validate(json.loads(resp.output_text), WEATHER)
        assert resp.text.format.type == "json_schema"
    streamed = respond(server, text=fmt, max_output_tokens=120, temperature=1.0, stream=True, extra_body={"seed": 9})
    text = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), WEATHER)


def test_json_object_is_an_object(server: Server) -> None:
    resp = respond(server, text={"format": {"type": "json_object"}}, max_output_tokens=64, extra_body={"seed": 2})
    assert resp.output_text.startswith("{")
    if resp.status == "completed":
        assert isinstance(json.loads(resp.output_text), dict)


def test_function_call_items_are_the_chat_history(server: Server) -> None:
    """A function_call and its function_call_output are rendered as the chat request's
    assistant tool call and tool message: the prompts have the same tokens."""
    arguments = '{"city":"Paris","days":3}'
    items: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "forecast", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
    ]
    resp = respond(server, input=items, tools=[TOOL])
    call = {"id": "call_1", "type": "function", "function": {"name": "forecast", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
    ]
    tools: Any = [
        {"type": "function", "function": {"name": "forecast", "description": "The weather", "parameters": FORECAST}}
    ]
    answer = chat(server, messages, tools=tools)
    assert resp.usage.input_tokens == answer.usage.prompt_tokens


def test_previous_response_id_continues_a_stored_response(server: Server) -> None:
    first = respond(server, input="Hello.", store=True, instructions="Be brief.")
    assert first.store is True
    second = respond(server, input="And then?", previous_response_id=first.id, instructions="Be brief.")
    assert second.previous_response_id == first.id
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    answer = chat(server, messages)
    assert second.usage.input_tokens == answer.usage.prompt_tokens
    assert second.output_text == answer.choices[0].message.content
    assert server.client().responses.retrieve(first.id).output_text == first.output_text


def test_the_tool_loop_over_previous_response_id(server: Server) -> None:
    """A stored call, then its output as the next input: the model reads the call and its result."""
    tools: Any = {"tools": [TOOL], "tool_choice": "none"}
    called = respond(server, tools=[TOOL], tool_choice="required", max_output_tokens=80, store=True)
    (call,) = called.output
    output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}]
    resp = respond(server, input=output, previous_response_id=called.id, **tools)
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    messages = [
        {"role": "user", "content": "Say something."},
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny."},
    ]
    chat_tools: Any = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    answer = chat(server, messages, tools=chat_tools, tool_choice="none")
    assert resp.usage.input_tokens == answer.usage.prompt_tokens
    assert resp.output_text == answer.choices[0].message.content


def test_a_stored_response_belongs_to_its_key(server: Server) -> None:
    first = respond(server, store=True)
    with pytest.raises(openai.NotFoundError) as info:
        respond(server, key=OTHER_KEY, input="More.", previous_response_id=first.id)
    assert info.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client(OTHER_KEY).responses.retrieve(first.id)
    server.client().responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        server.client().responses.retrieve(first.id)


def test_an_unstored_response_cannot_be_continued(server: Server) -> None:
    first = respond(server)
    with pytest.raises(openai.NotFoundError):
        respond(server, input="More.", previous_response_id=first.id)


def test_a_streamed_response_is_stored(server: Server) -> None:
    events = list(respond(server, store=True, stream=True))
    done = events[-1].response
    assert server.client().responses.retrieve(done.id).output_text == done.output_text


def test_the_store_keeps_the_recently_used_per_key() -> None:
    store = ResponseStore(max_per_key=2, max_bytes_per_key=10_000)
    for i in range(3):
        store.put("a", {"id": f"r{i}"}, [])
    assert store.get("a", "r0") is None and store.get("a", "r1") is not None and store.get("b", "r1") is None
    store.put("a", {"id": "r3"}, [])  # r1 was used last: r2 goes
    assert store.get("a", "r2") is None and store.get("a", "r1") is not None
    by_bytes = ResponseStore(max_per_key=10, max_bytes_per_key=1_000)
    for i in range(4):  # about 300 bytes each: three fit
        by_bytes.put("a", {"id": f"r{i}", "text": "x" * 270}, [])
    assert by_bytes.count("a") == 3 and by_bytes.get("a", "r0") is None
    by_bytes.put("a", {"id": "huge", "text": "x" * 2_000}, [])  # past the bound alone: never kept
    assert by_bytes.get("a", "huge") is None and by_bytes.count("a") == 3


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"temperature": 3.0}, "temperature", "less than or equal to 2"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}}, "text.format", "schema"),
        ({"tool_choice": "required"}, None, "tool_choice is only allowed when tools are specified"),
        ({"background": True}, "background", "not supported"),
        ({"extra_body": {"n": 2}}, "n", "Unrecognized request argument"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, None, "input_image"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    server: Server, kwargs: dict[str, Any], param: str | None, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        respond(server, **kwargs)
    assert info.value.status_code == 400 and words in info.value.message, info.value.body
    if param is not None:
        assert info.value.param == param, info.value.body


def test_seed_and_other_chat_sampling_fields_pass_through(server: Server) -> None:
    a = respond(server, temperature=1.0, max_output_tokens=24, extra_body={"seed": 42})
    b = respond(server, temperature=1.0, max_output_tokens=24, extra_body={"seed": 42})
    c = respond(server, temperature=1.0, max_output_tokens=24, extra_body={"seed": 43})
    assert a.output_text == b.output_text != c.output_text


def test_errors_and_auth(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        respond(server, model="gpt-17")
    assert info.value.code == "model_not_found"
    bad = openai.OpenAI(api_key="wrong", base_url=f"{server.url}/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model="dummy", input="Hi")
    bad.close()
