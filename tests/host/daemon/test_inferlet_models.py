"""Inferlets as models: an inferlet speaking the chat protocol (the SDK's `chat_model`; here the
shipped `self_consistency` example), uploaded with `?model=NAME`, is the model `wafer/NAME` for
the key that uploaded it, through the OpenAI chat and completions, Responses and Anthropic
Messages APIs, streaming or not, with tools; no other key sees or calls it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from host.build import build
from host.sandbox.config import default_cache_dir
from tests.host.daemon.conftest import API_KEY, OTHER_KEY, Server
from tests.host.daemon.test_tools import SCHEMAS, TOOLS

MESSAGES: Any = [{"role": "user", "content": "What is 2 + 2?"}]
MODEL = "wafer/self-consistency"


@pytest.fixture(scope="module")
def model_id(server: Server) -> Iterator[str]:
    data = build("self_consistency", default_cache_dir()).wasm_path.read_bytes()
    with server.http() as http:
        response = http.post("/v1/inferlets", params={"model": "self-consistency"}, content=data)
        assert response.status_code in (200, 201), response.text
        body = response.json()
        assert body["model"] == MODEL
        yield str(body["id"])
        http.delete(f"/v1/inferlets/{body['id']}")


def _last_run_inferlet(server: Server) -> str:
    with server.http() as http:
        runs = http.get("/v1/runs", params={"limit": 1000}).json()["data"]
    return str(max(runs, key=lambda r: r["id"])["inferlet"])


def test_listed_and_described_for_its_key_only(server: Server, model_id: str) -> None:
    with server.http() as http, server.http(OTHER_KEY) as other:
        assert MODEL in [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
        assert MODEL not in [m["id"] for m in other.get("/v1/models").json()["data"]]
        assert other.get(f"/v1/models/{MODEL}").status_code == 404
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client(OTHER_KEY).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)


def test_chat_completions_run_the_inferlet(server: Server, model_id: str) -> None:
    client = server.client()
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=3)
    assert _last_run_inferlet(server) == model_id
    assert plain.model == MODEL and plain.usage is not None and plain.usage.prompt_tokens > 0
    assert plain.choices[0].finish_reason in ("stop", "length")
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=3, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content  # the same seeded samples, the same vote
    two = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2, seed=1)
    assert [c.index for c in two.choices] == [0, 1]
    completion = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=4, seed=2, stop=["\n"])
    assert "\n" not in completion.choices[0].text


def test_tools_through_the_inferlets_grammar(server: Server, model_id: str) -> None:
    resp = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, seed=5
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function"
        assert set(json.loads(call.function.arguments)) == set(SCHEMAS[call.function.name]["required"])


def test_responses_and_messages_run_the_inferlet(server: Server, model_id: str) -> None:
    response = server.client().responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=8)
    assert response.model == MODEL and response.status in ("completed", "incomplete")
    assert _last_run_inferlet(server) == model_id
    with anthropic.Anthropic(api_key=API_KEY, base_url=server.url, max_retries=0, timeout=60.0) as client:
        message = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        assert message.model == MODEL and message.usage.input_tokens > 0
        assert _last_run_inferlet(server) == model_id
        with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=8) as stream:
            assert stream.get_final_message().role == "assistant"


def test_names_are_checked_and_move_with_a_new_upload(server: Server, model_id: str) -> None:
    with server.http() as http:
        bad = http.post("/v1/inferlets", params={"model": "no/slashes"}, content=server.echo_wasm.read_bytes())
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
        echo = http.post("/v1/inferlets", params={"model": "self-consistency"}, content=server.echo_wasm.read_bytes())
        try:
            assert echo.json()["model"] == MODEL
            assert http.get(f"/v1/inferlets/{model_id}").json()["model"] is None  # the name moved
        finally:
            again = http.post("/v1/inferlets", params={"model": "self-consistency"}, content=b"")
            assert again.status_code == 400
            data = build("self_consistency", default_cache_dir()).wasm_path.read_bytes()
            http.post("/v1/inferlets", params={"model": "self-consistency"}, content=data)
            http.delete(f"/v1/inferlets/{echo.json()['id']}")
        assert http.get(f"/v1/inferlets/{model_id}").json()["model"] == MODEL
