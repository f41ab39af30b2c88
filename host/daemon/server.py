"""Serve the app with uvicorn: logging configured once, graceful shutdown bounded by the drain
timeout (streams still open then are closed; their runs are cancelled)."""

from __future__ import annotations

import uvicorn

from host.daemon.app import create_app
from host.daemon.config import DaemonConfig
from host.daemon.daemon import DaemonStartError
from host.daemon.logs import configure_logging


def uvicorn_config(config: DaemonConfig, announce: bool = False) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(config, announce=announce),
        host=config.host,
        port=config.port,
        log_config=None,  # ours (configure_logging), so every line is structured
        access_log=False,
        timeout_graceful_shutdown=max(1, int(config.drain_timeout_s)),
        lifespan="on",
    )


def serve(config: DaemonConfig) -> None:
    configure_logging(config.log_level, config.log_format)
    server = uvicorn.Server(uvicorn_config(config, announce=True))
    server.run()
    if not server.started:  # uvicorn logs a failed startup (or a busy port) and returns
        raise DaemonStartError(f"the daemon did not start on {config.url}; the log above says why")
