"""The Responses and Messages APIs on the torch driver with SmolLM2 (the embedded default model),
driven by the real openai and anthropic clients: a real answer, the stream equal to the whole
answer, a forced tool call and (Responses) a schema-constrained answer that validates."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

# test_smollm2's daemon fixture (`client`, an openai client), started once for this module too.
from tests.host.daemon.test_smollm2 import MODEL, PERSON, client

__all__ = ["client"]

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def url(client: openai.OpenAI) -> str:
    """The daemon's address."""
    return str(client.base_url).removesuffix("/").removesuffix("/v1")


def test_responses_on_smollm2(client: openai.OpenAI) -> None:
    ask: Any = {"model": MODEL, "input": QUESTION, "max_output_tokens": 20, "temperature": 0}
    resp = client.responses.create(**ask)
    assert "Paris" in resp.output_text
    events = client.responses.create(stream=True, **ask)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    tool: Any = {"type": "function", "name": "register", "parameters": PERSON}
    called = client.responses.create(
        model=MODEL,
        input="Register Alice, who is 30.",
        tools=[tool],
        tool_choice={"type": "function", "name": "register"},
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = called.output
    assert call.type == "function_call" and call.name == "register"
    jsonschema.validate(json.loads(call.arguments), PERSON)
    fmt: Any = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    person = client.responses.create(
        model=MODEL, input="Invent a person as JSON.", text=fmt, max_output_tokens=60, temperature=0
    )
    assert person.status == "completed"
    jsonschema.validate(json.loads(person.output_text), PERSON)


def test_messages_on_smollm2(url: str) -> None:
    with anthropic.Anthropic(api_key="none", base_url=url, max_retries=0, timeout=300.0) as messages_client:
        ask: Any = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 20}
        message = messages_client.messages.create(extra_body={"temperature": 0}, **ask)
        assert "Paris" in message.content[0].text
        with messages_client.messages.stream(extra_body={"temperature": 0}, **ask) as stream:
            assert "".join(stream.text_stream) == message.content[0].text
        tool: Any = {"name": "register", "input_schema": PERSON}
        used = messages_client.messages.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Register Alice, who is 30."}],
            tools=[tool],
            tool_choice={"type": "tool", "name": "register"},
            max_tokens=60,
            extra_body={"temperature": 0},
        )
        (block,) = used.content
        assert used.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "register"
        jsonschema.validate(block.input, PERSON)
