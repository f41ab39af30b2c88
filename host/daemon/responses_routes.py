"""`POST /v1/responses` (the OpenAI Responses API) and its stored responses: a request becomes a
chat request (instructions, history and input items as chat messages; function tools; text
formats) served by the chat path, and the run's results are written as a response.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter

from host.daemon.chat_adapter import chat_preparer, chat_request, passed_through
from host.daemon.errors import BadRequest, NotFound
from host.daemon.http_util import daemon_of, key_id_of, parse_body
from host.daemon.openai_routes import serve_chat
from host.daemon.responses_models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputMessage,
    NamedFunction,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from host.daemon.responses_render import ResponsesWire, new_id
from host.daemon.responses_store import ResponseStore

router = APIRouter(tags=["openai"])

# Chat fields this API sets from its own, and what it calls them (for the 400s).
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "temperature": "temperature",
    "top_p": "top_p",
    "tool_choice": "tool_choice",
}
_NATIVE = frozenset(_PARAMS)
_ITEMS = TypeAdapter(list[InputItem])


def _store(request: Request) -> ResponseStore:
    store = request.app.state.response_store
    assert isinstance(store, ResponseStore)
    return store


@router.post(
    "/v1/responses",
    summary="Create a model response (OpenAI Responses API)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ResponsesRequest"}}},
        }
    },
    response_model=None,
)
async def create_response(request: Request) -> JSONResponse | StreamingResponse:
    req = await parse_body(request, ResponsesRequest)
    key = key_id_of(request)
    store = _store(request)
    if req.background:
        raise BadRequest("background responses are not supported", param="background", code="unsupported_parameter")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(key, req.previous_response_id)
        if previous is None:
            raise NotFound(
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = list(previous.history)
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    history += chat_messages(items)
    fields = _chat_fields(req, history)
    chat = chat_request(fields, _PARAMS)
    base = _echo(req)

    def on_done(response: dict[str, Any]) -> None:
        if req.store:
            store.put(key, response, history + chat_messages(_ITEMS.validate_python(response["output"])))

    rule = daemon_of(request).config.json_object_requires_json_word
    prepare = chat_preparer(_PARAMS, json_object_requires_json_word=rule, owner=key)
    return await serve_chat(request, "responses", chat, prepare, ResponsesWire(base, on_done))


@router.get("/v1/responses/{response_id}", summary="Get a stored response")
async def get_response(request: Request, response_id: str) -> dict[str, Any]:
    stored = _store(request).get(key_id_of(request), response_id)
    if stored is None:
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    return stored.response


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response")
async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
    if not _store(request).delete(key_id_of(request), response_id):
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input (or output) items as chat messages: consecutive function calls become one
    assistant message's tool calls (joining the assistant text before them)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            assert isinstance(item, InputMessage)
            messages.append({"role": item.role, "content": item.text()})
    return messages


def _chat_fields(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    fields = passed_through(req.model_extra, _NATIVE)
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    fields.update(model=req.model, messages=instructions + history, stream=bool(req.stream))
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
    ):
        if value is not None:
            fields[name] = value
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJsonSchema):
        schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(fmt, TextFormatJsonObject):
        fields["response_format"] = {"type": "json_object"}
    if req.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None and (req.tools or choice == "required"):
        fields["tool_choice"] = choice
    return fields


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The response's fields that repeat the request."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "id": new_id("resp"),
        "model": req.model,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice)
        or "auto",
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "store": bool(req.store),
        "metadata": req.metadata or {},
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
    }
