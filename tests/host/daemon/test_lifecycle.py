"""A second, differently configured daemon: the concurrent-run limit (429), a stream whose client
goes away (its run is cancelled), and graceful shutdown (running runs are cancelled after the
drain timeout; the driver process is stopped)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from host.daemon.app import create_app
from host.daemon.config import load_config
from host.daemon.daemon import Daemon
from tests.host.daemon.conftest import API_KEY, Server, _free_port


@pytest.fixture
def small(server: Server, tmp_path: Path) -> Iterator[tuple[Server, Daemon, uvicorn.Server]]:
    # `server` first: the session fixture has built the inferlets this daemon loads.
    config = load_config(
        {
            "port": _free_port(),
            "api_keys": [API_KEY],
            "max_concurrent_runs": 1,
            "drain_timeout_s": 0.5,
            "cache_dir": str(server.config.cache_dir),
            "data_dir": str(tmp_path),
            "log_level": "warning",
        },
        environ={},
    )
    daemon = Daemon(config)
    uv = uvicorn.Server(uvicorn.Config(create_app(config, daemon), host=config.host, port=config.port, log_config=None))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        assert thread.is_alive(), "the second daemon did not start"
        time.sleep(0.05)
    srv = Server(config.url, config, server.echo_wasm)
    srv.wait_ready()
    yield srv, daemon, uv
    uv.should_exit = True
    thread.join(timeout=30)
    for client in srv.clients.values():
        client.close()


def test_limit_disconnect_and_shutdown(small: tuple[Server, Daemon, uvicorn.Server]) -> None:
    srv, daemon, uv = small
    with srv.http() as http:
        echo_id = http.post("/v1/inferlets", content=srv.echo_wasm.read_bytes()).json()["id"]
        # A chat stream whose client leaves after the first chunks: its run is cancelled.
        body = {"model": "dummy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 400, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            next(response.iter_lines())
        chat_run = daemon.runs.list("chat")[-1]
        assert chat_run.done.wait(30)
        assert chat_run.state.value in ("cancelled", "succeeded")  # it may have finished first

        run_id = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["decode"]}).json()["id"]
        refused = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["decode"]})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "too_many_runs"
        chat = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert chat.status_code == 429

    pid = daemon.supervisor.status().pid
    assert pid is not None
    uv.should_exit = True  # graceful shutdown: the decode run never ends by itself
    record = daemon.runs.get(run_id)
    assert record.done.wait(60)
    assert record.state.value == "cancelled"
    while daemon.supervisor.status().state.value != "stopped":
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the driver process is gone (reaped by the supervisor)
