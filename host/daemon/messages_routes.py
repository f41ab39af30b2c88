"""`POST /v1/messages` (the Anthropic Messages API): a request becomes a chat request (system,
text, tool_use and tool_result blocks as chat messages; tools; tool_choice) served by the chat
path, and the run's results are written as a message. Errors here take Anthropic's envelope
(app.py and the edge middleware ask `messages_render.speaks_anthropic`).
"""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from host.daemon.chat_adapter import chat_preparer, chat_request, passed_through
from host.daemon.errors import BadRequest
from host.daemon.http_util import daemon_of, key_id_of, parse_body
from host.daemon.messages_models import (
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolUseBlock,
)
from host.daemon.messages_render import MESSAGES_PATH, MessagesWire
from host.daemon.openai_prepare import check_model
from host.daemon.openai_routes import serve_chat

router = APIRouter(tags=["anthropic"])

# Chat fields this API sets from its own, and what it calls them (for the 400s).
_PARAMS = {
    "messages": "messages",
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "tool_choice": "tool_choice",
    "response_format": "output_config.format",
    "parameters": "input_schema",
}
_NATIVE = frozenset(_PARAMS)


@router.post(
    MESSAGES_PATH,
    summary="Create a message (Anthropic Messages API)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/MessagesRequest"}}},
        }
    },
    response_model=None,
)
async def create_message(request: Request) -> JSONResponse | StreamingResponse:
    req = await parse_body(request, MessagesRequest)
    chat = chat_request(_chat_fields(req), _PARAMS)
    rule = daemon_of(request).config.json_object_requires_json_word
    prepare = chat_preparer(_PARAMS, json_object_requires_json_word=rule, owner=key_id_of(request))
    return await serve_chat(request, "messages", chat, prepare, MessagesWire(req.model))


@router.post(
    MESSAGES_PATH + "/count_tokens",
    summary="Count a message request's input tokens (Anthropic Messages API)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/MessagesRequest"}}},
        }
    },
)
async def count_tokens(request: Request) -> dict[str, Any]:
    """The prompt the request would have, counted by the same preparation as `create_message`
    (so a request it would refuse is refused here too); nothing is generated."""
    req = await parse_body(request, CountTokensRequest)
    chat = chat_request(_chat_fields(req), _PARAMS)
    daemon = daemon_of(request)
    rule = daemon.config.json_object_requires_json_word
    prepare = chat_preparer(_PARAMS, json_object_requires_json_word=rule, owner=key_id_of(request))

    def count() -> int:
        engine = daemon.engine()
        check_model(chat.model, daemon.served_model())
        return prepare(chat, engine.model, engine.tokenizer, engine.grammars).prompt_tokens

    return {"input_tokens": await anyio.to_thread.run_sync(count)}


def chat_messages(system: str | list[TextBlock] | None, messages: list[MessageParam]) -> list[dict[str, Any]]:
    """The system prompt and the messages as chat messages: an assistant's tool_use blocks become
    its tool calls, a user's tool_result blocks tool messages (before the user's text)."""
    chat: list[dict[str, Any]] = []
    if system is not None:
        chat.append({"role": "system", "content": system if isinstance(system, str) else _text(system)})
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
            continue
        texts: list[TextBlock] = []
        calls = []
        num_results = 0
        for j, block in enumerate(message.content):
            if isinstance(block, TextBlock):
                texts.append(block)
                continue
            kind, role = ("tool_use", "assistant") if isinstance(block, ToolUseBlock) else ("tool_result", "user")
            if message.role != role:
                raise BadRequest(
                    f"{kind} blocks belong in {role} messages", param=f"messages.{i}.content.{j}", code="invalid_value"
                )
            if isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
                )
            else:
                chat.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
                num_results += 1
        if message.role == "assistant":
            reply: dict[str, Any] = {"role": "assistant", "content": _text(texts) if texts or not calls else None}
            if calls:
                reply["tool_calls"] = calls
            chat.append(reply)
        elif texts or not num_results:
            chat.append({"role": "user", "content": _text(texts)})
    return chat


def _text(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)


def _chat_fields(req: MessagesRequest) -> dict[str, Any]:
    fields = passed_through(req.model_extra, _NATIVE)
    messages = chat_messages(req.system, req.messages)
    fields.update(model=req.model, messages=messages, stream=bool(req.stream), max_completion_tokens=req.max_tokens)
    if req.stop_sequences:
        fields["stop"] = req.stop_sequences
    for name, value in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k)):
        if value is not None:
            fields[name] = value
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:  # Anthropic's structured outputs are strict: undeclared properties are refused
        schema = {"name": "output", "schema": fmt.schema_, "strict": True}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if req.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ToolChoiceAny):
        fields["tool_choice"] = "required"
    elif req.tools and isinstance(choice, ToolChoiceAuto | ToolChoiceNone):
        fields["tool_choice"] = choice.type
    return fields
