"""response_format on the dummy driver with the real openai client: the chat inferlet masks
every step with the grammar (compiled on the host), so the content parses and validates."""

from __future__ import annotations

import json

import jsonschema

from tests.host.daemon.conftest import Server

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "The weather as JSON, please."}]


def _schema_format() -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


def test_json_schema_content_validates(server: Server) -> None:
    client = server.client()
    for seed in range(3):
        resp = client.chat.completions.create(
            model="dummy",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=_schema_format(),  # type: ignore[arg-type]
            max_tokens=120,
            seed=seed,
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_schema_streamed_content_validates(server: Server) -> None:
    client = server.client()
    stream = client.chat.completions.create(
        model="dummy",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=_schema_format(),  # type: ignore[arg-type]
        max_tokens=120,
        seed=7,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_content_is_an_object(server: Server) -> None:
    client = server.client()
    for seed in range(4):
        resp = client.chat.completions.create(
            model="dummy",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format={"type": "json_object"},
            max_tokens=64,
            seed=seed,
        )
        choice = resp.choices[0]
        content = choice.message.content or ""
        assert content.startswith("{"), content
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(content), dict)
