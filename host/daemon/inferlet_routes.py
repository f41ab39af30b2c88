"""Inferlet endpoints: upload a component (named by its content hash, under a per-key quota),
list and delete uploads, start runs of one, follow a run's output and messages (SSE), send it
messages, cancel it, list runs (a page at a time). A key is always required here (see
`middleware.py`): these endpoints run code.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from host.daemon.daemon import CHAT_INFERLET, ENGINE_WAIT_S
from host.daemon.errors import BadRequest, RunInboxFull
from host.daemon.http_util import (
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    SSE_HEADERS,
    daemon_of,
    key_id_of,
    list_page,
    parse_body,
    sse,
)
from host.daemon.inferlet_store import UploadQuota
from host.sandbox.errors import InboxFull

router = APIRouter(tags=["inferlets"])

MAX_ARGS = 1024

PageLimit = Annotated[int, Query(ge=1, le=LIST_LIMIT_MAX, description=f"items in this page, at most {LIST_LIMIT_MAX}")]


class StartRun(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inferlet: StrictStr = Field(description="an uploaded inferlet's id (sha256:...) or 'chat', the built-in one")
    args: Annotated[list[StrictStr], Field(max_length=MAX_ARGS)] = []


class RunMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: StrictStr | None = Field(default=None, description="delivered to the run's receive()")
    close: StrictBool = Field(default=False, description="after this, the run's receive() returns none")


def _body(model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


_WASM_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/wasm": {"schema": {"type": "string", "format": "binary"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post("/v1/inferlets", summary="Upload an inferlet component", openapi_extra=_WASM_BODY, status_code=201)
async def upload(
    request: Request,
    shared: Annotated[bool, Query(description="visible to every API key, not only this one")] = False,
    model: Annotated[
        str,
        Query(description="call it as model `wafer/<model>` through the chat APIs (it must speak the chat protocol)"),
    ] = "",
) -> JSONResponse:
    data = await request.body()
    daemon = daemon_of(request)
    quota = UploadQuota(daemon.config.key_max_uploads, daemon.config.key_max_upload_bytes)
    entry, is_new = await anyio.to_thread.run_sync(daemon.store.add, data, key_id_of(request), shared, quota, model)
    return JSONResponse(entry.describe(), status_code=201 if is_new else 200)


@router.get("/v1/inferlets", summary="List uploaded inferlets, a page at a time")
async def list_inferlets(
    request: Request,
    after: Annotated[str, Query(description="the last id of the previous page")] = "",
    limit: PageLimit = LIST_LIMIT_DEFAULT,
) -> dict[str, Any]:
    entries = daemon_of(request).store.list(key_id_of(request), after, limit + 1)
    return list_page([e.describe() for e in entries], limit)


@router.get("/v1/inferlets/{inferlet_id}", summary="Describe an uploaded inferlet")
async def get_inferlet(request: Request, inferlet_id: str) -> dict[str, Any]:
    return daemon_of(request).store.get(inferlet_id, key_id_of(request)).describe()


@router.delete("/v1/inferlets/{inferlet_id}", summary="Delete an inferlet this key uploaded")
async def delete_inferlet(request: Request, inferlet_id: str) -> dict[str, Any]:
    await anyio.to_thread.run_sync(daemon_of(request).store.delete, inferlet_id, key_id_of(request))
    return {"id": inferlet_id, "object": "inferlet", "deleted": True}


@router.post("/v1/runs", summary="Start a run of an inferlet", openapi_extra=_body(StartRun), status_code=201)
async def start_run(request: Request) -> JSONResponse:
    daemon = daemon_of(request)
    body = await parse_body(request, StartRun)
    if body.inferlet == CHAT_INFERLET:
        component = daemon.chat_component
    else:
        component = await anyio.to_thread.run_sync(daemon.store.load, body.inferlet, key_id_of(request))
    record, _ = await daemon.runs.start(
        component, body.inferlet, "inferlet", ENGINE_WAIT_S, lambda _engine: (body.args, None), owner=key_id_of(request)
    )
    return JSONResponse(record.describe(), status_code=201)


@router.get("/v1/runs", summary="List runs and their states, a page at a time")
async def list_runs(
    request: Request,
    kind: str | None = None,
    after: Annotated[int, Query(ge=0, description="the last id of the previous page")] = 0,
    limit: PageLimit = LIST_LIMIT_DEFAULT,
) -> dict[str, Any]:
    if kind not in (None, "inferlet", "chat"):
        raise BadRequest("kind is 'inferlet' or 'chat'", param="kind")
    records = daemon_of(request).runs.list(kind, key_id_of(request), after, limit + 1)
    return list_page([r.describe() for r in records], limit)


@router.get("/v1/runs/{run_id}", summary="Describe a run")
async def get_run(request: Request, run_id: int) -> dict[str, Any]:
    return daemon_of(request).runs.get(run_id, key_id_of(request)).describe()


@router.get("/v1/runs/{run_id}/events", summary="Follow a run: output, messages and its end, as SSE")
async def run_events(
    request: Request, run_id: int, after: Annotated[int, Query(ge=-1, description="last seq already seen")] = -1
) -> StreamingResponse:
    record = daemon_of(request).runs.get(run_id, key_id_of(request))

    async def events() -> AsyncIterator[bytes]:
        try:
            async for event in record.log.follow(after + 1):
                if event.kind == "output":
                    yield sse({"seq": event.seq, "text": event.data}, "output")
                elif event.kind == "message":
                    yield sse({"seq": event.seq, "message": event.data}, "message")
                else:
                    yield sse({"seq": event.seq, **event.data}, "end")
        except LookupError as exc:
            yield sse(
                {
                    "error": {
                        "message": str(exc),
                        "type": "invalid_request_error",
                        "param": "after",
                        "code": "events_dropped",
                    }
                },
                "error",
            )
        except asyncio.CancelledError:
            raise  # the follower left; the run goes on

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/runs/{run_id}/messages", summary="Send a message to a run", openapi_extra=_body(RunMessage))
async def send_message(request: Request, run_id: int) -> dict[str, Any]:
    record = daemon_of(request).runs.get(run_id, key_id_of(request))
    body = await parse_body(request, RunMessage)
    if body.message is None and not body.close:
        raise BadRequest("send a message, or close: true", param="message")
    if record.outcome is not None:
        raise BadRequest(f"run {run_id} has ended ({record.state.value})", param="run_id", code="run_ended")
    if body.message is not None:
        try:
            record.log.push(body.message)
        except InboxFull as exc:
            raise RunInboxFull(f"run {run_id} is not receiving: {exc} (run_max_inbound_mib)") from None
    if body.close:
        record.log.close_inbox()
    return record.describe()


@router.post("/v1/runs/{run_id}/cancel", summary="Cancel a run")
async def cancel_run(request: Request, run_id: int) -> dict[str, Any]:
    record = daemon_of(request).runs.get(run_id, key_id_of(request))
    record.cancel()
    # A cancelled run stops at its next host call; a moment is usually enough to report it.
    await anyio.to_thread.run_sync(record.done.wait, 5.0)
    return record.describe()
