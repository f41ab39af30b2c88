"""The HTTP edge, as one pure-ASGI middleware: request ids, API-key checks, body size limits,
the access log and the latency histogram. It answers refusals itself, in the OpenAI envelope
(Anthropic's on the Messages routes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import Histogram

from host.daemon.config import DaemonConfig
from host.daemon.console import OPEN_PATHS as CONSOLE_PATHS
from host.daemon.console import STATE_PATH as CONSOLE_STATE_PATH
from host.daemon.errors import ApiError, Forbidden, PayloadTooLarge, Unauthorized
from host.daemon.logs import request_id_var
from host.daemon.messages_render import anthropic_envelope, speaks_anthropic

log = logging.getLogger("wafer.daemon.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# Paths open without a key: probes and the API description.
_OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
# Paths that run user code: a key is required even when the OpenAI API is open.
_CODE_PREFIXES = ("/v1/inferlets", "/v1/runs")
UPLOAD_PATH = "/v1/inferlets"


async def send_error(send: Send, error: ApiError, request_id: str, path: str) -> None:
    envelope = anthropic_envelope(error) if speaks_anthropic(path) else error.envelope()
    body = json.dumps(envelope).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.append((b"x-request-id", request_id.encode()))
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _given_key(headers: dict[str, str]) -> str:
    """The key a request presents: `Authorization: Bearer <key>`, or `x-api-key: <key>` (how
    Anthropic's clients send it) when there is no bearer token."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, config: DaemonConfig, latency: Histogram) -> None:
        self._app = app
        self._config = config
        self._latency = latency
        self._keys = tuple(k.encode() for k in config.api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        request_id = given if _CLIENT_REQUEST_ID.match(given) else f"req_{secrets.token_hex(8)}"
        token = request_id_var.set(request_id)
        started = time.monotonic()
        status = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        path: str = scope.get("path", "")
        try:
            refusal = self._refusal(path, headers)
            if refusal is not None:
                status[0] = refusal.status
                await send_error(send, refusal, request_id, path)
                return
            # Who is asking, for run ownership: a digest of the key, never the key itself.
            given_key = _given_key(headers)
            scope.setdefault("state", {})["key_id"] = self._key_id(given_key) if given_key or not self._keys else ""
            await self._app(scope, self._limited(receive, path), send_with_id)
        except PayloadTooLarge:
            if status[0] == 0:  # nothing sent yet: the client gets its 413
                status[0] = 413
                await send_error(send, PayloadTooLarge(self._limit(path)), request_id, path)
        finally:
            elapsed = time.monotonic() - started
            route = scope.get("route")
            route_path = getattr(route, "path", "unmatched")
            self._latency.labels(scope.get("method", ""), route_path, str(status[0])).observe(elapsed)
            log.info(
                "%s %s %d %.1f ms",
                scope.get("method"),
                path,
                status[0],
                elapsed * 1000,
                extra={
                    "method": scope.get("method"),
                    "path": path,
                    "status": status[0],
                    "duration_ms": round(elapsed * 1000, 1),
                },
            )
            request_id_var.reset(token)

    def _limit(self, path: str) -> int:
        return self._config.max_upload_bytes if path == UPLOAD_PATH else self._config.max_request_bytes

    def _refusal(self, path: str, headers: dict[str, str]) -> ApiError | None:
        if path in _OPEN_PATHS or path in CONSOLE_PATHS:  # the console's page and files
            return None
        if path == CONSOLE_STATE_PATH and not _given_key(headers):  # engine-wide only, as /metrics
            return None
        is_code = path.startswith(_CODE_PREFIXES)
        if is_code and not self._keys:
            return Forbidden(
                "inferlet endpoints are disabled: configure api_keys to upload and run inferlets",
                code="inferlets_disabled",
            )
        if self._keys and not self._is_key_valid(_given_key(headers)):
            return Unauthorized()
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._limit(path):
            return PayloadTooLarge(self._limit(path))
        return None

    def _key_id(self, token: str) -> str:
        if not self._keys:
            return ""
        return hashlib.sha256(token.encode()).hexdigest()[:16]

    def _is_key_valid(self, token: str) -> bool:
        if not token:
            return False
        given = token.encode()
        # Compare against every key in constant time: timing must not reveal a prefix.
        return any([hmac.compare_digest(given, key) for key in self._keys])

    def _limited(self, receive: Receive, path: str) -> Receive:
        """Count body bytes as they arrive: a chunked body has no Content-Length to check."""
        limit = self._limit(path)
        seen = [0]

        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise PayloadTooLarge(limit)  # the app's ApiError handler answers it
            return message

        return wrapped
