"""Operations: /health, /metrics, the OpenAPI document, request ids, and the edge refusals that
need a differently configured daemon (checked on the middleware itself)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from host.daemon.config import load_config
from host.daemon.metrics import Registry
from host.daemon.middleware import EdgeMiddleware
from host.engine import Engine
from tests.host.daemon.conftest import Server, _free_port, serving


def test_health(server: Server) -> None:
    body = server.wait_ready()
    driver = body["driver"]
    assert isinstance(driver, dict)
    assert body["status"] == "ok" and driver["state"] == "ready"
    engine = body["engine"]
    assert isinstance(engine, dict)
    assert engine["model"] == "dummy" and engine["max_context"] == 512
    assert engine["driver_info"] == {"device": "none (the dummy driver computes nothing)"}  # the handshake's
    assert "speculation_hits" in engine["speculation"]
    assert "running" in body["runs"]  # type: ignore[operator]


def test_metrics(server: Server) -> None:
    server.client().chat.completions.create(model="dummy", messages=[{"role": "user", "content": "m"}], max_tokens=3)
    with server.http(key=None) as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "wafer_http_request_duration_seconds_bucket",
        "wafer_passes_total",
        "wafer_pass_tokens_total",
        "wafer_batch_size_mean",
        "wafer_speculation_total",
        "wafer_runs_ended_total",
        "wafer_driver_up 1.0",
        'wafer_openai_requests_total{endpoint="chat",outcome="ok"}',
        # vLLM's set, under wafer's prefix (docs/operating.md, "Metrics")
        "wafer_requests_running ",
        "wafer_requests_waiting 0.0",
        "wafer_kv_cache_usage_ratio ",
        "# TYPE wafer_prefix_cache_hits_total counter",
        "# TYPE wafer_prefix_cache_queries_total counter",
    ):
        assert name in text, name
    assert 'route="/v1/chat/completions"' in text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    chat = '{endpoint="chat"}'
    assert samples[f"wafer_prompt_tokens_total{chat}"] > 0
    assert samples[f"wafer_generation_tokens_total{chat}"] >= 3  # this test's 3, and others'
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "inter_token_latency"):
        assert samples[f"wafer_{histogram}_seconds_count{chat}"] >= 1, histogram
    assert 0.0 <= samples["wafer_kv_cache_usage_ratio"] <= 1.0
    # Every metric the shipped Grafana dashboard charts is one the daemon exports.
    dashboard = (Path(__file__).resolve().parents[3] / "docs" / "grafana-dashboard.json").read_text()
    charted = {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"\bwafer_[a-z0-9_]+", dashboard)}
    assert len(charted) >= 10
    for name in charted:
        assert f"# TYPE {name} " in text, name


def test_openapi_document(server: Server) -> None:
    with server.http(key=None) as http:
        doc = http.get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/inferlets", "/v1/runs", "/health"):
        assert path in doc["paths"], path
    schemas = doc["components"]["schemas"]
    assert "ChatCompletionRequest" in schemas and "Message" in schemas
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}


def test_request_ids(server: Server) -> None:
    with server.http() as http:
        assert http.get("/v1/models", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
        generated = http.get("/v1/models", headers={"x-request-id": "bad id with spaces"}).headers["x-request-id"]
        assert generated.startswith("req_")
        missing = http.get("/v1/nothing")
        assert missing.headers["x-request-id"].startswith("req_")
        assert len(missing.headers.get_list("x-request-id")) == 1


async def _call(app: EdgeMiddleware, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, Any]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    await app(scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"]) if sent[1]["body"] else None


def test_without_keys_the_openai_api_is_open_and_inferlets_are_disabled() -> None:
    async def inner(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = EdgeMiddleware(
        inner, load_config({}, environ={}), Registry().histogram("h", "h", ("method", "route", "status"))
    )

    async def main() -> None:
        assert (await _call(app, "GET", "/v1/models", []))[0] == 200
        for path in ("/v1/inferlets", "/v1/runs", "/v1/runs/1/cancel"):
            status, body = await _call(app, "POST", path, [])
            assert status == 403 and body["error"]["code"] == "inferlets_disabled"

    anyio.run(main)


def test_an_exhausted_page_pool_degrades_health_and_refuses_new_runs(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As if running runs held every KV page (one run alone cannot: run_max_pages_fraction).
    monkeypatch.setattr(Engine, "num_available_pages", property(lambda self: 0))
    with server.http() as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert health.json()["engine"]["available_pages"] == 0
        refused = http.post("/v1/runs", json={"inferlet": "chat"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "kv_pages_exhausted"
        chat = http.post(
            "/v1/chat/completions", json={"model": "dummy", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status_code == 503 and "KV pages are held by running runs" in chat.json()["error"]["message"]
    monkeypatch.undo()
    assert server.wait_ready()["status"] == "ok"


def test_a_prompt_past_what_one_run_may_hold_is_a_400_not_a_failed_run(
    server: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # 16 pages of 16 tokens and run_max_pages_fraction 0.5: one run holds at most 128 tokens, so
    # the API's context length is 128, not the driver's 512. A longer prompt was accepted and
    # then failed mid-run with a 502 (the page quota); now it is refused up front.
    config = dataclasses.replace(
        server.config,
        driver_args=(*server.config.driver_args, "--num-pages", "16", "--page-size", "16"),
        port=_free_port(),
        data_dir=tmp_path_factory.mktemp("small-pool-data"),
    )
    with serving(config, server.echo_wasm) as srv:
        engine = srv.wait_ready()["engine"]
        assert isinstance(engine, dict) and engine["max_context"] == 512 and engine["max_kept_context"] == 128
        with srv.http() as http:
            body = {"model": "dummy", "prompt": [65] * 200, "max_tokens": 4}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded" and "128" in error["message"]
            body["prompt"] = [65] * 100
            assert http.post("/v1/completions", json=body).status_code == 200


def test_without_the_grammar_extra_a_schema_is_a_400_naming_it(
    server: Server, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # wafer installed without its `grammar` extra (no xgrammar): structured output and tools are
    # refused with a 400 that says what to install, not a 500, and plain requests still work.
    monkeypatch.setitem(sys.modules, "host.grammar", None)  # importing it raises ImportError
    config = dataclasses.replace(server.config, port=_free_port(), data_dir=tmp_path_factory.mktemp("no-grammar-data"))
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    chat = {"model": "dummy", "messages": [{"role": "user", "content": "json please"}], "max_tokens": 4}
    refused = [({**chat, "response_format": schema}, "response_format"), ({**chat, "tools": [tool]}, "tools")]
    with serving(config, server.echo_wasm) as srv, srv.http() as http:
        for body, param in refused:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "grammar_unavailable" and error["param"] == param, error
            assert "pip install 'wafer[grammar]'" in error["message"], error
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
