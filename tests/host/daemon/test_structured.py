"""response_format on the dummy driver with the real openai client: the chat inferlet masks
every step with the grammar (compiled on the host), so the content parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from host.daemon.errors import BadRequest
from host.daemon.openai_models import ChatCompletionRequest
from host.daemon.openai_prepare import prepare_chat
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


def test_json_object_needs_no_word_json_unless_configured(server: Server) -> None:
    """vLLM, SGLang and llama.cpp accept json_object whatever the messages say, and clients
    written for them rely on it; `json_object_requires_json_word` restores OpenAI's rule."""
    messages = [{"role": "user", "content": "The weather, please."}]
    resp = server.client().chat.completions.create(
        model="dummy",
        messages=messages,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=32,
        seed=0,
    )
    assert (resp.choices[0].message.content or "").startswith("{")
    req = ChatCompletionRequest.model_validate(
        {"model": "dummy", "messages": messages, "response_format": {"type": "json_object"}}
    )
    assert server.daemon is not None
    engine, _ = server.daemon.supervisor.engine(timeout_s=30)
    with pytest.raises(BadRequest, match="must contain the word 'json'") as info:
        prepare_chat(req, engine.model, engine.tokenizer, engine.grammars, json_object_requires_json_word=True)
    assert info.value.param == "messages"


def test_40_concurrent_requests_mixing_constrained_and_plain(server: Server) -> None:
    """Each constrained request has its own schema (its own property name): an output that
    validates against its own schema shows no grammar state crossed between requests."""
    from concurrent.futures import ThreadPoolExecutor

    client = server.client()

    def schema_for(i: int) -> dict[str, object]:
        name = f"k{i}"
        props = {name: {"type": "integer", "minimum": 0, "maximum": 99}}
        return {"type": "object", "properties": props, "required": [name], "additionalProperties": False}

    def one(i: int) -> tuple[int, str, str | None]:
        kwargs: dict[str, object] = {}
        if i % 2 == 0:
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema_for(i), "strict": True}}
            kwargs["response_format"] = fmt
        resp = client.chat.completions.create(
            model="dummy",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=40,
            seed=i,
            **kwargs,  # type: ignore[arg-type]
        )
        choice = resp.choices[0]
        return i, choice.message.content or "", choice.finish_reason

    with ThreadPoolExecutor(max_workers=40) as pool:
        results = list(pool.map(one, range(40)))
    assert len(results) == 40
    for i, content, finish in results:
        if i % 2 == 0:
            assert finish == "stop", (i, content)
            jsonschema.validate(json.loads(content), schema_for(i))
        else:
            assert finish in ("stop", "length")


def test_a_draft_04_schema_is_checked_against_its_own_draft(server: Server) -> None:
    """Draft-04 spellings that 2020-12 reads as invalid (a boolean exclusiveMinimum, a list of
    items) are valid in the draft the schema declares: the request is served, not a 400."""
    schema = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 9},
            "pair": {"type": "array", "items": [{"type": "boolean"}, {"type": "boolean"}], "additionalItems": False},
        },
        "required": ["n", "pair"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "d4", "schema": schema, "strict": True}}
    resp = server.client().chat.completions.create(
        model="dummy",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=fmt,  # type: ignore[arg-type]
        max_tokens=60,
        seed=1,
    )
    choice = resp.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.Draft4Validator(schema).validate(json.loads(choice.message.content or ""))


def test_a_long_max_length_is_enforced_not_refused(server: Server) -> None:
    """A string bound above 32 characters (common in real schemas: 255, 1024) compiles slower but
    is enforced: the request is served and a finished output keeps within it."""
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string", "minLength": 36, "maxLength": 40}},
        "required": ["note"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "note", "schema": schema, "strict": True}}
    finished = 0
    for seed in range(4):
        resp = server.client().chat.completions.create(
            model="dummy",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=fmt,  # type: ignore[arg-type]
            max_tokens=120,
            seed=seed,
        )
        choice = resp.choices[0]
        if choice.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(choice.message.content or ""), schema)
    assert finished > 0
