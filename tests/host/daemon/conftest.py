"""Daemon fixtures: one real server per session (uvicorn on a free port, in a thread) on the
dummy driver, which the daemon starts and supervises as a subprocess; the real `openai` client."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import uvicorn

from host.build import build
from host.daemon.app import create_app
from host.daemon.config import DaemonConfig, load_config
from host.daemon.daemon import Daemon
from host.sandbox.config import default_cache_dir

HERE = Path(__file__).resolve().parent
API_KEY = "test-key"
OTHER_KEY = "other-key"  # a second tenant: it must not see the first one's runs
MAX_CONTEXT = 512
MAX_REQUEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class Server:
    url: str
    config: DaemonConfig
    echo_wasm: Path
    daemon: Daemon | None = None  # the in-process daemon, for tests that look inside it
    clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    def http(self, key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        """One client per key for the session (closed at its end): a client owns a connection pool."""
        if key not in self.clients:
            self.clients[key] = openai.OpenAI(api_key=key, base_url=f"{self.url}/v1", max_retries=0, timeout=60.0)
        return self.clients[key]

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        with self.http() as http:
            while True:
                response = http.get("/health")
                if response.status_code == 200:
                    body: dict[str, object] = response.json()
                    return body
                if time.monotonic() > deadline:
                    raise AssertionError(f"daemon not healthy: {response.text}")
                time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cache_dir = default_cache_dir()
    # Built side by side, once per session (the build cache makes later sessions fast).
    with ThreadPoolExecutor(max_workers=2) as pool:
        chat = pool.submit(build, "chat", cache_dir)
        echo = pool.submit(build, str(HERE / "inferlets" / "echo"), cache_dir)
        chat.result()
        echo_wasm = echo.result().wasm_path
    config = load_config(
        {
            "host": "127.0.0.1",
            "port": _free_port(),
            "api_keys": [API_KEY, OTHER_KEY],
            "driver": "dummy",
            # A small pass latency keeps a long generation in flight long enough to kill its driver.
            "driver_args": ["--max-context", str(MAX_CONTEXT), "--pass-latency-ms", "2"],
            "max_request_bytes": MAX_REQUEST_BYTES,
            "max_upload_bytes": 64 * 1024 * 1024,
            "run_max_output_mib": 4,
            "run_max_inbound_mib": 1,
            "restart_backoff_initial_s": 0.1,
            "drain_timeout_s": 2.0,
            "cache_dir": str(cache_dir),
            "data_dir": str(tmp_path_factory.mktemp("daemon-data")),
            "log_level": "warning",
        },
        environ={},
    )
    with serving(config, echo_wasm) as srv:
        yield srv


@contextmanager
def serving(config: DaemonConfig, echo_wasm: Path, wait_ready: bool = True) -> Iterator[Server]:
    """The daemon for `config`, in this process, served by uvicorn in a thread (once its driver is
    ready, unless `wait_ready` is False)."""
    daemon = Daemon(config)
    app = create_app(config, daemon)
    # Keep-alive past any pause between tests: uvicorn closes an idle connection after 5 s by
    # default, and a client (max_retries=0) that sends on its pooled connection just as the server
    # closes it loses the request ("connection error"); a loaded machine makes such pauses common.
    uv = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_config=None, access_log=False, timeout_keep_alive=600
        )
    )
    thread = threading.Thread(target=uv.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the daemon did not start")
        time.sleep(0.05)
    srv = Server(config.url, config, echo_wasm, daemon)
    if wait_ready:
        srv.wait_ready()
    try:
        yield srv
    finally:
        for client in srv.clients.values():
            client.close()
        uv.should_exit = True
        thread.join(timeout=30)
