"""The ASGI application: routers, the edge middleware, the one mapping of errors to the OpenAI
error envelope, the OpenAPI document, and the daemon's start and stop around serving."""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from host.daemon import console, inferlet_routes, messages_routes, openai_routes, ops_routes, responses_routes
from host.daemon.banner import announce_when_ready
from host.daemon.config import DaemonConfig
from host.daemon.daemon import Daemon
from host.daemon.errors import ApiError, BadRequest
from host.daemon.messages_models import MessagesRequest
from host.daemon.messages_render import anthropic_envelope, speaks_anthropic
from host.daemon.middleware import EdgeMiddleware
from host.daemon.openai_models import ChatCompletionRequest, CompletionRequest
from host.daemon.responses_models import ResponsesRequest
from host.daemon.responses_store import ResponseStore

SWITCH_INTERVAL_S = 0.001

log = logging.getLogger("wafer.daemon")

_DOCUMENTED_BODIES: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    MessagesRequest,
    inferlet_routes.StartRun,
    inferlet_routes.RunMessage,
)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


def create_app(config: DaemonConfig, daemon: Daemon | None = None, announce: bool = False) -> FastAPI:
    """`announce`: print the URL and examples to stderr once the driver is ready (`wafer serve`)."""
    daemon = daemon if daemon is not None else Daemon(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await anyio.to_thread.run_sync(daemon.start)
        # The loaded model, compiled components and imported modules are
        # long-lived: move them out of the collector's generations so a full
        # collection walks only what requests allocate (a gen-2 pass over the
        # ~200k startup objects paused every thread for 150-200 ms).
        gc.freeze()
        # Many threads hand each request on (HTTP, run, engine loop, bridge reader); while one
        # key's threads compute, each hand-off waits for the switch interval. At 1 ms instead
        # of Python's 5 a victim key's p99 beside a 1,000-context run was 1.98-2.15x idle
        # (2.16-2.74x at 5 ms; bench/tenancy.py --attacks crowd).
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        log.info("wafer daemon started; serving HTTP on %s", config.url)
        if announce:
            announce_when_ready(daemon, config.url)
        try:
            yield
        finally:
            log.info("wafer daemon stopping: draining runs for up to %g s", config.drain_timeout_s)
            await anyio.to_thread.run_sync(daemon.stop)

    app = FastAPI(
        title="wafer",
        version="0.1.0",
        description="wafer's daemon: an OpenAI-compatible API served by inferlets, and inferlet runs over HTTP.",
        lifespan=lifespan,
    )
    app.state.daemon = daemon
    app.state.response_store = ResponseStore()
    app.include_router(ops_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(messages_routes.router)
    app.include_router(inferlet_routes.router)
    app.include_router(console.router)
    _add_error_handlers(app)
    app.add_middleware(EdgeMiddleware, config=config, latency=daemon.latency)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _error_response(request: Request, error: ApiError) -> JSONResponse:
    # The edge middleware adds X-Request-Id (and WWW-Authenticate) to every response.
    envelope = anthropic_envelope(error) if speaks_anthropic(request.url.path) else error.envelope()
    return JSONResponse(envelope, status_code=error.status)


def _add_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return _error_response(request, exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("path", "query", "body")]
        param = ".".join(loc) or None
        return _error_response(request, BadRequest(f"Invalid value for '{param}': {first.get('msg', '')}", param=param))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        error = ApiError(str(exc.detail))
        error.status = exc.status_code
        error.error_type = _ERROR_TYPES.get(exc.status_code, "server_error")
        return _error_response(request, error)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error", exc_info=exc)
        return _error_response(request, ApiError("internal server error; the daemon logged the details"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the request bodies the routes parse themselves (strictly)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in _DOCUMENTED_BODIES:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    error = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
    schemas["ErrorEnvelope"] = error
    app.openapi_schema = doc
    return doc
