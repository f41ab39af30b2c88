"""The daemon on two supervised dummy driver replicas: both serve, /health and /metrics report
each, and killing one fails only the requests on it, restarts it, and the rest keep serving."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from host.engine import ReplicatedEngine
from tests.host.daemon.conftest import Server, _free_port, serving

MESSAGES: Any = [{"role": "user", "content": "Tell a long story."}]
PAGES = (3000, 4000)  # each replica's own driver argument (after the common driver_args)


@pytest.fixture(scope="module")
def pair(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = dataclasses.replace(
        server.config,
        drivers=tuple(f"dummy --num-pages {n}" for n in PAGES),
        port=_free_port(),
        data_dir=tmp_path_factory.mktemp("replicas-data"),
    )
    with serving(config, server.echo_wasm) as srv:
        yield srv


def _replicas(srv: Server) -> list[dict[str, Any]]:
    with srv.http() as http:
        replicas: list[dict[str, Any]] = http.get("/health").json()["replicas"]
    return replicas


def _wait_all_ready(srv: Server, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = _replicas(srv)
        if all(r["driver"]["state"] == "ready" and r["serving"] for r in replicas):
            return replicas
        assert time.monotonic() < deadline, replicas
        time.sleep(0.05)


def test_health_and_metrics_report_each_replica(pair: Server) -> None:
    replicas = _wait_all_ready(pair)
    assert [r["index"] for r in replicas] == [0, 1]
    assert replicas[0]["driver"]["pid"] != replicas[1]["driver"]["pid"]
    assert all(r["engine"]["num_pages"] > 0 and "forwards" in r["engine"]["driver_stats"] for r in replicas)
    assert tuple(r["engine"]["num_pages"] for r in replicas) == PAGES  # each ran with its own arguments
    with pair.http() as http:
        health = http.get("/health").json()
        text = http.get("/metrics").text
    assert health["status"] == "ok"
    assert health["engine"]["num_pages"] == sum(r["engine"]["num_pages"] for r in replicas)
    assert 'wafer_replica_up{replica="0"} 1' in text and 'wafer_replica_up{replica="1"} 1' in text
    assert 'wafer_replica_stat{name="available_pages",replica="1"}' in text


def test_killing_one_replica_fails_only_its_requests_and_it_restarts(pair: Server) -> None:
    assert pair.daemon is not None
    before = _wait_all_ready(pair)
    engine = pair.daemon.engine()
    assert isinstance(engine, ReplicatedEngine)
    client = pair.client()
    streams = [
        client.chat.completions.create(
            model="dummy", messages=MESSAGES, max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(4)
    ]
    outcomes: list[str] = [""] * len(streams)
    started = [threading.Event() for _ in streams]

    def consume(i: int) -> None:
        try:
            for n, _chunk in enumerate(streams[i]):
                if n == 3:  # generating (a run that has generated nothing would be started again)
                    started[i].set()
            outcomes[i] = "ok"
        except Exception as exc:  # the stream of a killed replica ends with an error
            outcomes[i] = f"error: {exc}"
        finally:
            started[i].set()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(60)
    running = [r for r in pair.daemon.runs.list("chat") if r.outcome is None]
    placed = {r.run_id: engine.placement(r.run_id) for r in running}
    assert len(placed) == 4 and {p[0] for p in placed.values() if p is not None} == {0, 1}
    os.kill(before[1]["driver"]["pid"], signal.SIGKILL)
    for t in threads:
        t.join(120)
    by_replica = {run_id: p[0] for run_id, p in placed.items() if p is not None}
    assert outcomes.count("ok") == list(by_replica.values()).count(0), outcomes
    assert all("driver" in o for o in outcomes if o != "ok"), outcomes
    for record in pair.daemon.runs.list("chat"):
        if record.run_id in by_replica:
            record.done.wait(30)
            assert (record.state.value == "succeeded") == (by_replica[record.run_id] == 0), record.describe()
            if by_replica[record.run_id] == 1:
                assert record.driver_lost.startswith("replica 1:"), record.driver_lost
    # The replica comes back under a new process; requests go on succeeding meanwhile.
    response = client.chat.completions.create(model="dummy", messages=MESSAGES, max_tokens=5)
    assert response.choices[0].finish_reason in ("stop", "length")
    after = _wait_all_ready(pair)
    assert after[1]["driver"]["restarts"] == before[1]["driver"]["restarts"] + 1
    assert after[1]["driver"]["pid"] != before[1]["driver"]["pid"]
    assert after[0]["driver"]["pid"] == before[0]["driver"]["pid"] and after[0]["driver"]["restarts"] == 0
    for _ in range(4):  # both replicas serve again
        response = client.chat.completions.create(model="dummy", messages=MESSAGES, max_tokens=5)
        assert response.choices


@pytest.fixture(scope="module")
def affine_pair(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = dataclasses.replace(
        server.config,
        drivers=tuple(f"dummy --num-pages {n}" for n in PAGES),
        prefix_match_unit=16,  # the dummy's page size
        port=_free_port(),
        data_dir=tmp_path_factory.mktemp("affine-data"),
    )
    with serving(config, server.echo_wasm) as srv:
        yield srv


def test_with_prefix_reuse_a_prompt_goes_where_its_prefix_is_cached(affine_pair: Server) -> None:
    """A long prompt, cached on one replica, is sent again while that replica is the busier one:
    it goes there all the same (by load alone it would go to the other, and compute it again)."""
    daemon = affine_pair.daemon
    assert daemon is not None
    engine = daemon.engine()
    assert isinstance(engine, ReplicatedEngine)
    _wait_all_ready(affine_pair)
    client = affine_pair.client()
    system = "You answer in one short line. " * 8  # some 15 pages
    prompt: Any = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
    assert client.chat.completions.create(model="dummy", messages=prompt, max_tokens=4).choices
    cached = [r["engine"]["prefix"]["prefix_cached_pages"] for r in _replicas(affine_pair)]
    home = cached.index(max(cached))
    assert cached[home] >= 10 and cached[1 - home] == 0, cached

    streams, load = [], [0, 0]
    while load[home] <= load[1 - home]:  # long runs elsewhere until the prompt's home is the busier
        stream = client.chat.completions.create(
            model="dummy", messages=MESSAGES, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # generating: placed
        streams.append(stream)
        live = [r.run_id for r in daemon.runs.list("chat") if r.outcome is None]
        load = [0, 0]
        for run_id in live:
            placed = engine.placement(run_id)
            if placed is not None:
                load[placed[0]] += 1
    before = [r["engine"]["prefix"]["prefix_tokens_reused"] for r in _replicas(affine_pair)]
    assert client.chat.completions.create(model="dummy", messages=prompt, max_tokens=4).choices
    after = [r["engine"]["prefix"]["prefix_tokens_reused"] for r in _replicas(affine_pair)]
    assert after[home] - before[home] >= 10 * 16 and after[1 - home] == before[1 - home], (before, after, load)
    for stream in streams:
        stream.close()
