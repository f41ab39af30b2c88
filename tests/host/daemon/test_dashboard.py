"""The console (host/daemon/console): its page and files load without a key, its live state
needs one and shows only that key's runs, its rates and run usage are real, a daemon without
keys shows every run; and the runs-by-inferlet counter it sits beside in /metrics."""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import re
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from host.daemon.console.state import Counters, rates_between
from host.daemon.metrics import BoundedCounts
from tests.host.daemon.conftest import API_KEY, OTHER_KEY, Server, _free_port, serving
from tests.host.daemon.sse import events

STATE = "/dashboard/state"


def key_digest(key: str) -> str:
    """The daemon's id for a key (host/daemon/middleware.py): what run ownership records."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def roomy(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The session's daemon with room for runs that decode on: its driver stops a context at 512
    tokens (about a second of decoding there), this one at the dummy's 32,768, and each pass takes
    5 ms."""
    config = dataclasses.replace(
        server.config,
        driver_args=("--pass-latency-ms", "5"),
        port=_free_port(),
        data_dir=tmp_path_factory.mktemp("console-data"),
    )
    with serving(config, server.echo_wasm) as srv:
        yield srv


@pytest.fixture(scope="module")
def echo_id(roomy: Server) -> str:
    for key in (API_KEY, OTHER_KEY):  # each key needs its own right to the upload
        with roomy.http(key) as http:
            response = http.post("/v1/inferlets", content=roomy.echo_wasm.read_bytes())
            assert response.status_code in (200, 201), response.text
    return str(response.json()["id"])


def state_of(srv: Server, key: str | None = API_KEY) -> dict[str, Any]:
    with srv.http(key) as http:
        response = http.get(STATE)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def start(srv: Server, key: str, inferlet: str, mode: str) -> int:
    with srv.http(key) as http:
        response = http.post("/v1/runs", json={"inferlet": inferlet, "args": [mode]})
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def end(srv: Server, key: str, run_id: int) -> None:
    with srv.http(key) as http:
        http.post(f"/v1/runs/{run_id}/cancel")


def running_ids_of(srv: Server, key: str) -> set[int]:
    with srv.http(key) as http:
        runs = http.get("/v1/runs", params={"limit": 1000}).json()["data"]
    return {r["id"] for r in runs if r["state"] == "running"}


@pytest.fixture
def two_tenants(roomy: Server, echo_id: str) -> Iterator[tuple[int, int]]:
    """A run of this key and one of the other key, both waiting in receive()."""
    mine, theirs = start(roomy, API_KEY, echo_id, "echo"), start(roomy, OTHER_KEY, echo_id, "echo")
    yield mine, theirs
    end(roomy, API_KEY, mine)
    end(roomy, OTHER_KEY, theirs)


def test_the_page_and_its_files_load_without_a_key(roomy: Server) -> None:
    with roomy.http(key=None) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="/dashboard/app.js"' in page.text and 'href="/dashboard/style.css"' in page.text
        assert len(set(re.findall(r'data-metric="([^"]+)"', page.text))) >= 6
        # Nothing from elsewhere: no CDN, no external fonts, and a policy that forbids them.
        assert "http://" not in page.text.replace('"http://www.w3.org', "") and "https://" not in page.text
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
        script = http.get("/dashboard/app.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert "/dashboard/state" in script.text and "sessionStorage" in script.text
        css = http.get("/dashboard/style.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert "@import" not in css.text and "url(" not in css.text


def test_without_a_key_the_state_is_the_engines_alone(roomy: Server, two_tenants: tuple[int, int]) -> None:
    """With keys configured, no key gets what /metrics shows anyone (rates, KV usage,
    replicas), no run of any key, not even a count; a wrong key is a 401."""
    with roomy.http(key=None) as http:
        state = http.get(STATE)
        assert state.status_code == 200, state.text
        body = state.json()
    assert body["scope"] == "engine" and body["key"] == ""
    assert body["runs"] == {"running": None, "ended": {}, "items": []}
    assert body["driver"]["state"] == "ready" and body["replicas"] and "kv_usage" in body["engine"]
    assert all(str(run_id) not in json.dumps(body["runs"]) for run_id in two_tenants)
    with roomy.http(key="not-a-key") as http:
        refused = http.get(STATE)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    with roomy.http() as http:
        # The files beside the page are open; nothing else under /dashboard is.
        assert http.get("/dashboard/other").status_code == 404


def test_a_key_sees_its_own_runs_and_nothing_of_another_keys(roomy: Server, two_tenants: tuple[int, int]) -> None:
    mine, theirs = two_tenants
    for key, own, other in ((API_KEY, mine, theirs), (OTHER_KEY, theirs, mine)):
        with roomy.http(key) as http:
            raw = http.get(STATE).text
        body = state_of(roomy, key)
        ids = {item["id"] for item in body["runs"]["items"]}
        assert own in ids and other not in ids, (key, ids)
        assert body["scope"] == "key" and body["key"] == key_digest(key)[:8]
        # Every run shown is the key's own, and the counts are of its runs alone.
        assert {item["key"] for item in body["runs"]["items"]} == {key_digest(key)[:8]}
        assert body["runs"]["running"] == len(running_ids_of(roomy, key))
        other_key = OTHER_KEY if key == API_KEY else API_KEY
        assert key_digest(other_key)[:8] not in raw
    # Its runs' ends are counted for it alone: the other key's run ending changes nothing here.
    before = state_of(roomy)["runs"]
    end(roomy, OTHER_KEY, theirs)
    after = state_of(roomy)["runs"]
    assert after["ended"] == before["ended"] and after["running"] == before["running"]


def test_the_state_reports_engine_rates_run_usage_and_replicas(roomy: Server, echo_id: str) -> None:
    run_id = start(roomy, API_KEY, echo_id, "decode")
    try:
        with roomy.http() as http, http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            next(data for name, data in events(response) if name == "output")  # it is decoding
        state_of(roomy)
        time.sleep(0.7)  # past the sampling interval: the next reading gives rates
        body = state_of(roomy)
    finally:
        end(roomy, API_KEY, run_id)
    engine = body["engine"]
    assert engine["passes_per_s"] > 0 and engine["generated_per_s"] > 0 and engine["computed_per_s"] > 0
    assert engine["batch_size"] >= 1
    assert 0 < engine["kv_usage"] <= 1 and engine["num_pages"] > engine["available_pages"]
    assert body["history"]["passes_per_s"][-1] == engine["passes_per_s"]
    assert len(body["history"]["t"]) == len(body["history"]["generated_per_s"]) >= 1
    run = next(item for item in body["runs"]["items"] if item["id"] == run_id)
    assert run["state"] == "running" and run["inferlet"] == echo_id and run["kind"] == "inferlet"
    assert run["tokens"] > len("forever") and run["pages"] >= 1 and run["contexts"] == 1 and run["age_s"] >= 0
    assert body["driver"]["state"] == "ready" and body["model"]
    [replica] = body["replicas"]
    assert replica["state"] == "ready" and replica["serving"] and replica["pid"] > 0


def test_without_keys_every_run_is_visible(server: Server, tmp_path_factory: pytest.TempPathFactory) -> None:
    config = dataclasses.replace(
        server.config, api_keys=(), port=_free_port(), data_dir=tmp_path_factory.mktemp("console-open-data")
    )
    with serving(config, server.echo_wasm) as srv, srv.http(key=None) as http:
        chat = {"model": "dummy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        completed = http.post("/v1/chat/completions", json=chat)
        assert completed.status_code == 200, completed.text
        response = http.get(STATE)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["scope"] == "all" and body["key"] == ""
        [run] = body["runs"]["items"]
        assert run["kind"] == "chat" and run["inferlet"] == "chat" and run["state"] == "succeeded"
        assert body["runs"]["ended"]["succeeded"] == 1


def test_rates_between_two_readings() -> None:
    before = Counters(at_s=10.0, passes=100, requests=300, computed=1000, generated=300, forward_s=1.0)
    after = Counters(
        at_s=12.0, passes=110, requests=340, computed=1050, generated=340, forward_s=1.2, itl_sum_s=0.5, itl_count=10
    )
    rates = rates_between(before, after)
    assert (rates.passes_per_s, rates.generated_per_s, rates.computed_per_s) == (5.0, 20.0, 25.0)
    assert rates.batch_size == 4.0 and rates.pass_ms == pytest.approx(20.0) and rates.itl_ms == pytest.approx(50.0)
    assert rates.ttft_ms is None  # no first tokens in the interval
    # A driver that restarted counts from zero again: its new count is the interval's.
    restarted = rates_between(after, Counters(at_s=13.0, passes=4, requests=8, generated=8))
    assert restarted.passes_per_s == 4.0 and restarted.batch_size == 2.0
    # A driver that does not count forward requests: sampled tokens per pass instead.
    uncounted = rates_between(Counters(at_s=0.0, requests=float("nan")), Counters(1.0, 2, float("nan"), 2, 6))
    assert uncounted.batch_size == 3.0 and uncounted.pass_ms is None
    idle = rates_between(after, dataclasses.replace(after, at_s=20.0))
    assert idle.passes_per_s == 0.0 and idle.batch_size is None and idle.itl_ms is None


def test_runs_by_inferlet_and_outcome_in_metrics(roomy: Server, echo_id: str) -> None:
    pattern = re.compile(r'^wafer_runs_by_inferlet_total\{inferlet="([^"]+)",outcome="([^"]+)"\} (\S+)$', re.M)

    def counts() -> dict[tuple[str, str], float]:
        with roomy.http(key=None) as http:
            text = http.get("/metrics").text
        return {(name, outcome): float(n) for name, outcome, n in pattern.findall(text)}

    before = counts()
    with roomy.http() as http:
        run_id = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["no-such-mode"]}).json()["id"]
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            assert [name for name, _ in events(response)][-1] == "end"
    after = counts()
    assert after[(echo_id, "failed")] == before.get((echo_id, "failed"), 0.0) + 1
    assert {k: v for k, v in after.items() if k != (echo_id, "failed")} == {
        k: v for k, v in before.items() if k != (echo_id, "failed")
    }


def test_bounded_counts_name_the_first_and_lump_the_rest() -> None:
    counts = BoundedCounts(max_names=2)
    for name, outcome in [("a", "ok"), ("b", "ok"), ("c", "ok"), ("a", "failed"), ("d", "ok"), ("b", "ok")]:
        counts.add(name, outcome)
    assert counts.counts() == {("a", "ok"): 1, ("b", "ok"): 2, ("other", "ok"): 2, ("a", "failed"): 1}


def test_every_static_file_ships_in_the_wheel() -> None:
    """The page's files are package data: each one matches a pattern pyproject.toml declares."""
    root = Path(__file__).resolve().parents[3]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    static = root / "host" / "daemon" / "console" / "static"
    files = sorted(p.relative_to(static.parent).as_posix() for p in static.iterdir())
    assert {"static/index.html", "static/app.js", "static/style.css"} <= set(files)
    assert all(any(fnmatch.fnmatch(f, pat) for pat in patterns["host.daemon.console"]) for f in files), files
