"""Small HTTP helpers shared by the routers: the daemon from the request, strict body parsing
into a pydantic model (400 naming the field), list pages, and SSE framing."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from host.daemon.daemon import Daemon
from host.daemon.errors import BadRequest

M = TypeVar("M", bound=BaseModel)


def daemon_of(request: Request) -> Daemon:
    daemon = request.app.state.daemon
    assert isinstance(daemon, Daemon)
    return daemon


def key_id_of(request: Request) -> str:
    """Digest of the caller's API key (set by the edge middleware; "" when keys are off)."""
    return str(getattr(request.state, "key_id", ""))


def request_id_of(request: Request) -> str:
    from host.daemon.logs import request_id_var

    return request_id_var.get() or "unknown"


async def parse_body(request: Request, model: type[M]) -> M:
    body = await request.body()
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> BadRequest:
    """The first problem, worded for a person, with the field path as `param`."""
    first = exc.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ()) if not _is_union_tag(p)]
    param = ".".join(loc) if loc else None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return BadRequest(f"the request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    if kind == "extra_forbidden":
        return BadRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return BadRequest(f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    if kind == "model_type" and not loc:
        return BadRequest("the request body must be a JSON object", code="invalid_json")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = f"'{param}'" if param else "the request"
    return BadRequest(f"Invalid value for {where}: {message}", param=param, code="invalid_value")


def _is_union_tag(part: object) -> bool:
    """pydantic names union members in error paths (`str`, `list[int]`, `function-after[...]`)."""
    if not isinstance(part, str):
        return False
    return (
        part in ("str", "int", "float", "bool")
        or "[" in part
        or part[:1].isupper()
        or part.startswith(("function-", "constrained-"))
    )


# A list endpoint answers at most this many items a page (`limit`), this many unless asked.
LIST_LIMIT_DEFAULT = 100
LIST_LIMIT_MAX = 1000


def list_page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """A page of a list, in OpenAI's shape, from up to `limit + 1` items in id order (an item
    past `limit` says that more follow: the next page is `after=<last_id>`)."""
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse(data: Any, event: str | None = None) -> bytes:
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {_json(data)}\n\n".encode()


class SseTemplate:
    """The SSE frame of a JSON object in which one string alone varies (a stream's content
    chunks): serialized once with `SLOT` in that string's place, then each frame escapes just its
    string. A frame is byte for byte what `sse` makes of the object holding that string."""

    SLOT = "\x00wafer-slot\x00"  # JSON escapes NUL, so no real text serializes to this

    def __init__(self, data: Any) -> None:
        slot = _json(self.SLOT)
        head, found, tail = sse(data).decode().partition(slot)
        if not found or slot in tail:
            raise ValueError("the template must hold SLOT exactly once, as a string value")
        self._head, self._tail = head, tail

    def frame(self, text: str) -> bytes:
        return f"{self._head}{_json(text)}{self._tail}".encode()


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
