"""Every refusal: its status, the OpenAI error envelope, and a server that keeps serving. 400s
come before any generation starts, with and without `stream: true`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.host.daemon.conftest import API_KEY, MAX_CONTEXT, MAX_REQUEST_BYTES, Server

OK_CHAT: dict[str, Any] = {"model": "dummy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OK_COMPLETION: dict[str, Any] = {"model": "dummy", "prompt": "hi", "max_tokens": 4}
LONG = "x" * (MAX_CONTEXT + 10)
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
# A lookbehind: valid for jsonschema (Python re), refused by the grammar engine.
BAD_PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

# (override, the param the error names or None)
BAD_CHAT: list[tuple[dict[str, Any], str | None]] = [
    ({"model": 3}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": 4.5}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"n": True}, "n"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, None),  # needs logprobs: true
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": "0.5"}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"logit_bias": {"1": 200}}, "logit_bias.1"),
    ({"logit_bias": {"one": 5}}, "logit_bias"),  # not a token id
    ({"logit_bias": {"100000": 5}}, "logit_bias"),  # outside the vocabulary
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"typical_p": 1.5}, "typical_p"),
    ({"stream_options": {"include_usage": True}, "stream": False}, None),
    ({"no_such_field": 1}, "no_such_field"),
    ({"messages": [{"role": "user", "content": LONG}]}, "messages"),  # longer than the context
    ({"max_tokens": MAX_CONTEXT}, "messages"),  # prompt + completion longer than the context
    ({"response_format": {"type": "xml"}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}}, None),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": BAD_SCHEMA}}},
        "response_format.json_schema.schema",
    ),
    ({"tools": []}, "tools"),  # an empty tool list is a mistake, not "no tools"
    (  # a schema jsonschema accepts but whose pattern the grammar engine cannot compile
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": BAD_PATTERN}}},
        "response_format",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "auto"}, None),  # tool_choice without tools
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, None),
]

BAD_COMPLETION: list[tuple[dict[str, Any], str | None]] = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [300, 1]}, "prompt"),  # outside the dummy's vocabulary of 260
    ({"prompt": [-1]}, None),
    ({"prompt": LONG}, "prompt"),
    ({"logprobs": 6}, "logprobs"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"max_tokens": MAX_CONTEXT}, "prompt"),
]


def _check_envelope(body: dict[str, Any], status: int, param: str | None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("override", "param"), BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_chat_400(server: Server, override: dict[str, Any], param: str | None, stream: bool) -> None:
    body = {**OK_CHAT, "stream": stream, **override}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    _check_envelope(response.json(), 400, param)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("override", "param"), BAD_COMPLETION, ids=[str(i) for i in range(len(BAD_COMPLETION))])
def test_completion_400(server: Server, override: dict[str, Any], param: str | None, stream: bool) -> None:
    body = {**OK_COMPLETION, "stream": stream, **override}
    with server.http() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    _check_envelope(response.json(), 400, param)


@pytest.mark.parametrize(
    "raw",
    [b"{", b"[]", b"null", b'"text"', b"", b'{"model": "dummy", "messages": [{"role": "user", "content": "\\ud800"}]}'],
)
def test_malformed_bodies(server: Server, raw: bytes) -> None:
    with server.http() as http:
        response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    _check_envelope(response.json(), 400, None)


def test_unknown_model_is_404(server: Server) -> None:
    with server.http() as http:
        for path, body in (("/v1/chat/completions", OK_CHAT), ("/v1/completions", OK_COMPLETION)):
            for stream in (False, True):
                response = http.post(path, json={**body, "model": "gpt-17", "stream": stream})
                assert response.status_code == 404
                assert response.json()["error"]["code"] == "model_not_found"
        response = http.get("/v1/models/gpt-17")
        assert response.status_code == 404
        _check_envelope(response.json(), 404, "model")
        response = http.get("/v1/no/such/route")
        assert response.status_code == 404
        _check_envelope(response.json(), 404, None)
        response = http.delete("/v1/models")
        assert response.status_code == 405
        _check_envelope(response.json(), 405, None)


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_401(server: Server, key: str | None) -> None:
    with server.http(key) as http:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/inferlets")):
            response = http.request(method, path, json=OK_CHAT)
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            _check_envelope(response.json(), 401, None)
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200  # probes stay open


def test_413(server: Server) -> None:
    big = {**OK_CHAT, "messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]}
    raw = json.dumps(big).encode()
    with server.http() as http:
        response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 413
        _check_envelope(response.json(), 413, None)

        def chunks() -> Any:  # no Content-Length: the limit is enforced as the body arrives
            for i in range(0, len(raw), 8192):
                yield raw[i : i + 8192]

        response = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert response.status_code == 413
        _check_envelope(response.json(), 413, None)
        still = http.post("/v1/chat/completions", json=OK_CHAT)
        assert still.status_code == 200, still.text  # still serving


def test_server_keeps_serving_after_errors(server: Server) -> None:
    client = server.client(API_KEY)
    response = client.chat.completions.create(model="dummy", messages=[{"role": "user", "content": "ok"}], max_tokens=3)
    assert response.choices[0].finish_reason in ("stop", "length")
