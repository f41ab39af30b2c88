"""The console's endpoints: the page and its two static files (open: they hold nothing live),
and its live state: with keys configured, a key's own runs, or without a key the engine-wide
view alone (rates, KV usage, replicas: what /metrics shows anyone), never another key's runs."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from host.daemon.console.state import ANONYMOUS, Sampler, console_state
from host.daemon.http_util import daemon_of, key_id_of

router = APIRouter(tags=["console"])

PAGE_PATH = "/dashboard"
STATE_PATH = "/dashboard/state"
# Served files, by path: (file under static/, media type).
_STATIC = {
    PAGE_PATH: ("index.html", "text/html; charset=utf-8"),
    "/dashboard/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/dashboard/style.css": ("style.css", "text/css; charset=utf-8"),
}
# Paths the edge middleware serves without a key.
OPEN_PATHS = tuple(_STATIC)
# The page runs only its own script and style, and talks only to this daemon.
_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@functools.cache
def _read_static(name: str) -> bytes:
    return resources.files("host.daemon.console").joinpath("static", name).read_bytes()


async def _static(request: Request) -> Response:
    name, media_type = _STATIC[request.url.path]
    return Response(_read_static(name), media_type=media_type, headers=_HEADERS)


for _path in _STATIC:
    router.add_api_route(_path, _static, methods=["GET"], include_in_schema=_path == PAGE_PATH, summary="The console")


@router.get(STATE_PATH, summary="The console's live state: engine rates, this key's runs, replicas")
async def state(request: Request) -> JSONResponse:
    daemon = daemon_of(request)
    sampler = getattr(request.app.state, "console_sampler", None)
    if sampler is None:  # one per app; created on the event loop, so once
        sampler = request.app.state.console_sampler = Sampler(daemon)
    # With keys configured: a valid key's runs (the middleware refuses a wrong key), or with no
    # key at all the engine-wide view alone (what /metrics shows anyone), no run of any key.
    owner: str | None = None
    if daemon.config.api_keys:
        owner = key_id_of(request) or ANONYMOUS
    body: dict[str, Any] = await anyio.to_thread.run_sync(console_state, daemon, sampler, owner)
    return JSONResponse(body, headers={"Cache-Control": "no-store"})
