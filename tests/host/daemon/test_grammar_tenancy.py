"""Grammars through the OpenAI API, as tenants see them: a schema that refers to another document
is a 400 naming the reference, and a key's compiles are its own share of the compile workers."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from host.daemon.openai_models import ChatCompletionRequest
from host.daemon.openai_prepare import prepare_chat
from tests.host.daemon.conftest import API_KEY, OTHER_KEY, Server

MESSAGES = [{"role": "user", "content": "The weather as JSON, please."}]


def test_a_remote_ref_is_a_400_naming_it(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"$ref": "https://example.com/city.schema.json"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model="dummy",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=response_format,
            max_tokens=16,
        )
    body: Any = info.value.body
    assert body["param"] == "response_format" and body["code"] == "invalid_schema", body
    assert "$ref 'https://example.com/city.schema.json' (outside the schema) at /properties/city" in body["message"]


def test_prepare_chat_compiles_as_the_key_it_is_given(server: Server) -> None:
    """prepare_chat hands the compiler the key it is given (the share a key's compiles take)."""
    assert server.daemon is not None
    engine, _ = server.daemon.supervisor.engine(timeout_s=30)
    owners: list[str | None] = []

    class Recording:
        def compile(self, kind: str, text: str, options: dict[str, Any], *, owner: str | None = None) -> None:
            owners.append(owner)

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = ChatCompletionRequest.model_validate(
        {
            "model": "dummy",
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        }
    )
    prepare_chat(req, engine.model, engine.tokenizer, Recording, owner="key-a")  # type: ignore[arg-type]
    assert owners == ["key-a"]


def test_chat_requests_compile_as_their_key(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route gives prepare_chat the caller's key, so two keys' compiles are two shares."""
    from host.grammar.compiler import GrammarCompiler

    owners: list[str | None] = []
    original = GrammarCompiler.compile

    def recording(self: GrammarCompiler, *args: Any, **kwargs: Any) -> Any:
        owners.append(kwargs.get("owner"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GrammarCompiler, "compile", recording)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    for key in (API_KEY, OTHER_KEY):
        server.client(key).chat.completions.create(
            model="dummy",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=response_format,
            max_tokens=4,
        )
    # Each request compiles (or finds) its grammar in preparing and in its run: as its own key.
    assert all(owners) and len(set(owners)) == 2 and owners[0] == owners[1], owners
