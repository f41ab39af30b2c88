"""`POST /v1/messages` with the real anthropic client against the daemon on the dummy driver: the
same chat path as chat completions (greedy outputs and prompt token counts agree with the
equivalent chat request), Anthropic's stream events, tools, errors in Anthropic's envelope, and
`x-api-key` as well as bearer keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest

from host.daemon.openai_models import ChatCompletionRequest
from tests.host.daemon.conftest import API_KEY, Server
from tests.host.daemon.test_structured import SCHEMA as WEATHER
from tests.host.daemon.test_tools import FORECAST

TOOL: Any = {"name": "forecast", "description": "The weather", "input_schema": FORECAST}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {"name": "forecast", "description": "The weather", "parameters": FORECAST},
}
ASK: Any = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(api_key=API_KEY, base_url=server.url, max_retries=0, timeout=60.0) as c:
        yield c


def create(client: anthropic.Anthropic, sampling: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """`sampling`: temperature, top_p, top_k, seed (this anthropic client sends them as extra
    body fields: it has no arguments for them)."""
    params: dict[str, Any] = {"model": "dummy", "messages": ASK, "max_tokens": 12}
    params.update(kwargs)
    return client.messages.create(extra_body={"temperature": 0, **(sampling or {})}, **params)


def anthropic_error(exc: anthropic.APIStatusError) -> dict[str, Any]:
    """The `error` of Anthropic's envelope `{"type": "error", "error": {"type", "message"}}`."""
    assert isinstance(exc.body, dict) and exc.body["type"] == "error", exc.body
    error: dict[str, Any] = exc.body["error"]
    return error


def chat(server: Server, messages: list[Any], **kwargs: Any) -> Any:
    params: dict[str, Any] = {"model": "dummy", "messages": messages, "max_tokens": 12, "temperature": 0}
    params.update(kwargs)
    return server.client().chat.completions.create(**params)


def test_a_plain_message_is_the_chat_answer(server: Server, client: anthropic.Anthropic) -> None:
    message = create(client, system="Be brief.")
    assert message.type == "message" and message.role == "assistant" and message.model == "dummy"
    assert message.id.startswith("msg_")
    (block,) = message.content
    answer = chat(server, [{"role": "system", "content": "Be brief."}, *ASK])
    assert block.type == "text" and block.text == answer.choices[0].message.content
    assert message.usage.input_tokens == answer.usage.prompt_tokens
    assert message.usage.output_tokens == answer.usage.completion_tokens
    reasons = {"stop": "end_turn", "length": "max_tokens"}
    assert message.stop_reason == reasons[answer.choices[0].finish_reason] and message.stop_sequence is None


def test_system_blocks_and_content_blocks(server: Server, client: anthropic.Anthropic) -> None:
    message = create(
        client,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "something."}]}
        ],
    )
    answer = chat(server, [{"role": "system", "content": "Be brief."}, *ASK])
    assert message.content[0].text == answer.choices[0].message.content


def test_the_stream_has_anthropics_events_and_the_same_text(client: anthropic.Anthropic) -> None:
    whole = create(client, max_tokens=40)
    events = list(create(client, max_tokens=40, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens and events[0].message.content == []
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(model="dummy", messages=ASK, max_tokens=40, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == whole.stop_reason


def test_a_tool_is_used_with_a_valid_input(client: anthropic.Anthropic) -> None:
    for seed in range(3):
        message = create(
            client,
            tools=[TOOL],
            tool_choice={"type": "tool", "name": "forecast"},
            max_tokens=80,
            sampling={"temperature": 1.0, "seed": seed},
        )
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "forecast" and block.id.startswith("toolu_")
        jsonschema.validate(block.input, FORECAST)


def test_a_streamed_tool_use_streams_its_input(client: anthropic.Anthropic) -> None:
    kwargs: Any = {"tools": [TOOL], "tool_choice": {"type": "any"}, "max_tokens": 80}
    sampling = {"temperature": 1.0, "seed": 6}
    events = list(create(client, sampling, stream=True, **kwargs))
    kinds = [e.type for e in events]
    num_deltas = kinds.count("content_block_delta")
    assert num_deltas > 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * num_deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[1].content_block.type == "tool_use" and events[1].content_block.name == "forecast"
    assert {e.delta.type for e in events[2:-3]} == {"input_json_delta"} and events[-2].delta.stop_reason == "tool_use"
    arguments = json.loads("".join(e.delta.partial_json for e in events[2:-3]))
    jsonschema.validate(arguments, FORECAST)
    with client.messages.stream(model="dummy", messages=ASK, extra_body=sampling, **kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == arguments
    assert create(client, sampling, **kwargs).content[0].input == arguments


def test_tool_use_and_tool_result_blocks_are_the_chat_history(server: Server, client: anthropic.Anthropic) -> None:
    arguments = {"city": "Paris", "days": 3}
    messages: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "forecast", "input": arguments},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny."}]},
    ]
    message = create(client, messages=messages, tools=[TOOL])
    call = {"id": "toolu_1", "type": "function", "function": {"name": "forecast", "arguments": json.dumps(arguments)}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny."},
    ]
    answer = chat(server, history, tools=[CHAT_TOOL])
    assert message.usage.input_tokens == answer.usage.prompt_tokens


def test_stop_sequences_end_the_text(server: Server, client: anthropic.Anthropic) -> None:
    whole = create(client, max_tokens=40).content[0].text
    stop = whole[10:12]
    cut = create(client, max_tokens=40, stop_sequences=[stop])
    assert cut.content[0].text == whole[: whole.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    kwargs: Any = {"model": "dummy", "messages": ASK, "max_tokens": 40, "stop_sequences": [stop]}
    with client.messages.stream(extra_body={"temperature": 0}, **kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop


def test_output_config_format_parses_and_validates(client: anthropic.Anthropic) -> None:
    fmt: Any = {"format": {"type": "json_schema", "schema": WEATHER}}
    for seed in range(2):
        message = create(client, {"temperature": 1.0, "seed": seed}, output_config=fmt, max_tokens=120)
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), WEATHER)


def test_top_k_goes_to_the_chat_sampling(client: anthropic.Anthropic) -> None:
    """top_k is the chat request's: served once the chat request takes it, refused till then."""
    if "top_k" in ChatCompletionRequest.model_fields:
        assert create(client, {"top_k": 1}).content
    else:
        with pytest.raises(anthropic.BadRequestError) as info:
            create(client, {"top_k": 1})
        assert "top_k" in info.value.message


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"sampling": {"temperature": 3.0}}, "temperature"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "'stop_sequences'"),  # named as this API names it
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": 7}}}}, "schema"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, "nope"),
        ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
            "tool_use",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ],
)
def test_bad_requests_are_invalid_request_errors(
    client: anthropic.Anthropic, kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, **kwargs)
    error = anthropic_error(info.value)
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert words in error["message"], error


def test_errors_take_anthropics_envelope(server: Server, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        create(client, model="claude-17")
    assert anthropic_error(info.value)["type"] == "not_found_error"
    with server.http() as http:
        missing = http.post("/v1/messages", json={"model": "dummy", "messages": ASK})
        assert missing.status_code == 400
        body = missing.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in body["error"]["message"]


def _latest_chat_run(http: Any, headers: dict[str, str]) -> int:
    runs = http.get("/v1/runs?kind=chat&limit=1000", headers=headers).json()["data"]
    return max((run["id"] for run in runs), default=0)


def test_x_api_key_and_bearer_keys(server: Server) -> None:
    body = {"model": "dummy", "messages": ASK, "max_tokens": 4}
    with server.http(key=None) as http:
        denied = http.post("/v1/messages", json=body)
        assert denied.status_code == 401
        assert denied.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": denied.json()["error"]["message"]},
        }
        assert http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}).status_code == 401
        bearer = {"Authorization": f"Bearer {API_KEY}"}
        before = _latest_chat_run(http, bearer)
        served = http.post("/v1/messages", json=body, headers={"x-api-key": API_KEY})
        assert served.status_code == 200 and served.json()["type"] == "message"
        # The same key either way is the same tenant: its run is listed for the bearer key.
        assert _latest_chat_run(http, bearer) > before
        assert http.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
    wrong = anthropic.Anthropic(api_key="wrong", base_url=server.url, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        create(wrong)
    assert anthropic_error(info.value)["type"] == "authentication_error"
    wrong.close()


def test_count_tokens_is_the_messages_input_tokens(client: anthropic.Anthropic) -> None:
    ask: Any = {"system": "Be brief.", "tools": [TOOL], "messages": ASK}
    counted = client.messages.count_tokens(model="dummy", **ask)
    assert counted.input_tokens == create(client, **ask).usage.input_tokens
    assert client.messages.count_tokens(model="dummy", messages=ASK).input_tokens < counted.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-17", messages=ASK)
