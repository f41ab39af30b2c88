"""Operations endpoints: `/health` (driver state, runs, engine counters) and `/metrics`."""

from __future__ import annotations

from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from host.daemon.daemon import Daemon
from host.daemon.http_util import daemon_of
from host.daemon.supervisor import DriverState, DriverStatus
from host.engine import Engine

router = APIRouter(tags=["operations"])


def _health(daemon: Daemon) -> tuple[int, dict[str, Any]]:
    status = daemon.supervisor.status()
    is_ready = status.state is DriverState.READY
    engine = daemon.live_engine()
    statuses, replica_engines = daemon.supervisor.statuses(), daemon.supervisor.replica_engines()
    replicas: list[dict[str, Any]] = [
        {
            "index": i,
            "driver": _driver(s),
            "serving": replica is not None,  # runs are placed on it
            "engine": _replica(daemon, replica) if replica is not None else {},
        }
        for i, (s, replica) in enumerate(zip(statuses, replica_engines, strict=True))
    ]
    is_exhausted = engine is not None and engine.num_available_pages == 0
    is_partial = any(not r["serving"] for r in replicas)
    engine_info: dict[str, Any] = {}
    if engine is not None:
        engine_info = {
            "model": engine.model.name,
            "driver_info": dict(engine.handshake.driver_info),
            "max_context": engine.model.max_context,
            "max_kept_context": engine.model.kept_context,  # what one run's pages hold: the API's limit
            "free_pages": engine.num_free_pages,
            "available_pages": engine.num_available_pages,
            "num_pages": engine.num_pages,
            "speculation": engine.speculation_stats(),
            "prefix": engine.prefix_stats(),
            "driver_stats": daemon.driver_stats(),
        }
    body = {
        # degraded: serving, but every KV page is held (new runs get 503 until some end), or a
        # replica is down (its runs failed; the others serve)
        "status": ("degraded" if is_exhausted or is_partial else "ok") if is_ready else "unavailable",
        "driver": _driver(status),
        "runs": daemon.runs.counts(),
        "engine": engine_info,
        "replicas": replicas,
    }
    return (200 if is_ready else 503), body


def _driver(status: DriverStatus) -> dict[str, Any]:
    return {
        "state": status.state.value,
        "pid": status.pid,
        "restarts": status.num_restarts,
        "last_error": status.last_error or None,
        "generation": status.generation,
    }


def _replica(daemon: Daemon, engine: Engine) -> dict[str, Any]:
    return {
        "free_pages": engine.num_free_pages,
        "available_pages": engine.num_available_pages,
        "num_pages": engine.num_pages,
        "prefix": engine.prefix_stats(),
        "driver_info": dict(engine.handshake.driver_info),
        "driver_stats": daemon.replica_stats(engine),
    }


@router.get("/health", summary="Driver state, runs and engine counters (503 while the driver is down)")
async def health(request: Request) -> JSONResponse:
    code, body = await anyio.to_thread.run_sync(_health, daemon_of(request))
    return JSONResponse(body, status_code=code)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    text = await anyio.to_thread.run_sync(daemon_of(request).metrics.render)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
