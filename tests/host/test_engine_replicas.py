"""Driver replicas (host.engine.replicas) on real dummy drivers: processes on Unix and TCP
sockets, started by the engine or by the test (to kill one)."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from bridge_schema.batch import OutputSpec, Sampler
from host.engine import EngineConfig, ReplicatedEngine
from host.errors import ContextNotFound, ContextNotOwned, DriverFailed, EngineClosed, InvalidRequest
from host.services import PassRequest

PAGE = 4
ARGS = ("--num-pages", "256", "--page-size", str(PAGE))
_runs = itertools.count(1)


def fill(engine: ReplicatedEngine, run: int, ctx: int, tokens: list[int]) -> int:
    result = engine.forward(run, ctx, PassRequest(tokens=tokens, outputs=[OutputSpec(len(tokens) - 1, Sampler())]))
    return int(result.outputs[0].token)


def replica(engine: ReplicatedEngine, run: int) -> int:
    placed = engine.placement(run)
    assert placed is not None, f"run {run} was never placed"
    return placed[0]


@pytest.fixture(scope="module")
def pair() -> Iterator[ReplicatedEngine]:
    configs = [EngineConfig("dummy", ARGS, prefix_match_unit=PAGE, speculation_depth=1) for _ in range(2)]
    with ReplicatedEngine.start(configs) as engine:
        yield engine


def test_concurrent_runs_spread_over_both_replicas_and_complete(pair: ReplicatedEngine) -> None:
    runs = [next(_runs) for _ in range(8)]
    errors: list[BaseException] = []

    def one(run: int) -> None:
        try:
            ctx = pair.create_context(run)
            fill(pair, run, ctx, [run % 200 + 1, 7, 9])
            for _ in range(5):
                fill(pair, run, ctx, [3])
            assert pair.context_length(run, ctx) == 8
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(run,)) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    placed = [replica(pair, run) for run in runs]
    assert sorted(set(placed)) == [0, 1] and abs(placed.count(0) - placed.count(1)) <= 2
    for run in runs:
        pair.end_run(run)
    assert pair.num_available_pages == pair.num_pages  # cached pages aside, nothing held
    assert all(pair.run_usage(run) == (0, 0) for run in runs)


def test_context_ids_are_unique_across_replicas_and_owned_by_their_run(pair: ReplicatedEngine) -> None:
    a, b = next(_runs), next(_runs)
    for _ in range(3):
        pair.create_context(a)  # ids here run ahead of the replicas' own
    ctx_a, ctx_b = pair.create_context(a), pair.create_context(b)
    fill(pair, a, ctx_a, [1, 2])
    fill(pair, b, ctx_b, [5, 6])
    assert replica(pair, a) != replica(pair, b)  # the second run goes to the idle replica
    ids = {ctx_a, ctx_b, pair.create_context(a), pair.create_context(b)}
    assert len(ids) == 4 and min(ids) > 3
    with pytest.raises(ContextNotOwned, match=f"context {ctx_b} does not belong to run {a}"):
        fill(pair, a, ctx_b, [1])
    with pytest.raises(ContextNotFound, match="context 999999"):
        pair.context_length(a, 999999)
    # A replica is handed the ids the run knows: its own errors name them, nothing rewritten.
    engine = pair.replicas()[replica(pair, a)]
    assert engine is not None and engine.context_length(a, ctx_a) == 2
    with pytest.raises(InvalidRequest, match=f"cannot truncate context {ctx_a} of length 2 to 9"):
        pair.truncate_context(a, ctx_a, 9)
    pair.end_run(a)
    pair.end_run(b)


def test_forks_stay_with_their_parent(pair: ReplicatedEngine) -> None:
    busy, run = next(_runs), next(_runs)
    fill(pair, busy, pair.create_context(busy), [1])  # one replica has a run: `run` goes to the other
    parent = pair.create_context(run)
    fill(pair, run, parent, [1, 2, 3, 4, 5, 6])
    child = pair.fork_context(run, parent)
    grandchild = pair.fork_context(run, child)
    assert pair.replica_of(run, child) == pair.replica_of(run, grandchild) == pair.replica_of(run, parent)
    assert pair.replica_of(run, parent) != replica(pair, busy)
    fill(pair, run, grandchild, [9])
    assert pair.context_length(run, grandchild) == 7 and pair.context_length(run, parent) == 6
    assert pair.run_usage(run)[0] == 3
    pair.end_run(run)
    pair.end_run(busy)


def test_a_prompt_goes_where_its_prefix_is_cached(pair: ReplicatedEngine) -> None:
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # two full pages and one token
    first, other, again = next(_runs), next(_runs), next(_runs)
    fill(pair, first, pair.create_context(first), prompt)
    fill(pair, other, pair.create_context(other), [40, 41, 42, 43, 44])
    assert replica(pair, other) != replica(pair, first)
    fill(pair, first, pair.create_context(first), [1])  # `first` now holds more: load alone says the other one
    hits = pair.prefix_stats()["prefix_tokens_reused"]
    fill(pair, again, pair.create_context(again), prompt)
    assert replica(pair, again) == replica(pair, first)
    assert pair.prefix_stats()["prefix_tokens_reused"] == hits + 2 * PAGE  # reused there, not recomputed
    for run in (first, other, again):
        pair.end_run(run)


def test_an_unplaced_context_is_empty_and_can_be_released(pair: ReplicatedEngine) -> None:
    run = next(_runs)
    ctx = pair.create_context(run)
    assert pair.context_length(run, ctx) == 0 and pair.context_num_pages(run, ctx) == 0
    assert pair.run_usage(run) == (1, 0) and pair.placement(run) is None
    pair.release_context(run, ctx)
    with pytest.raises(ContextNotFound):
        pair.context_length(run, ctx)
    pair.end_run(run)


def test_replicas_that_serve_different_vocabularies_are_refused_at_start() -> None:
    configs = [EngineConfig("dummy", ARGS), EngineConfig("dummy", (*ARGS, "--vocab-size", "300"))]
    with pytest.raises(DriverFailed, match=r"replica 1 \(dummy\) serves vocab_size 300 .* the same model"):
        ReplicatedEngine.start(configs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_driver(address: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "drivers.dummy", "--listen", address, "--log-level", "WARNING", *ARGS]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "driver did not start"
        if address.startswith("unix:") and os.path.exists(address[5:]):
            return proc
        if address.startswith("tcp:"):
            try:
                socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=1).close()
                return proc
            except OSError:
                pass
        time.sleep(0.02)


def test_a_replica_that_dies_fails_only_its_runs_and_later_runs_succeed() -> None:
    workdir = tempfile.mkdtemp(prefix="wafer-test-")
    addresses = [f"unix:{os.path.join(workdir, 'a.sock')}", f"tcp:127.0.0.1:{_free_port()}"]
    procs = [_start_driver(address) for address in addresses]
    try:
        with ReplicatedEngine.start([EngineConfig(address) for address in addresses]) as engine:
            runs = [next(_runs) for _ in range(4)]
            contexts = {run: engine.create_context(run) for run in runs}
            for run in runs:
                fill(engine, run, contexts[run], [1, 2, 3])
            on = {run: replica(engine, run) for run in runs}
            assert sorted(on.values()) == [0, 0, 1, 1]
            procs[1].kill()
            procs[1].wait()
            for run in runs:
                if on[run] == 1:
                    with pytest.raises((DriverFailed, EngineClosed)):
                        for _ in range(1000):  # the loss is noticed by the first pass after it
                            fill(engine, run, contexts[run], [1])
                    engine.end_run(run)  # as the sandbox does: the dead replica now has the fewest runs
                else:
                    fill(engine, run, contexts[run], [4])  # the other replica keeps serving
            later = [next(_runs) for _ in range(3)]
            for run in later:
                ctx = engine.create_context(run)
                fill(engine, run, ctx, [5, 6])
                fill(engine, run, engine.fork_context(run, ctx), [7])
                assert replica(engine, run) == 0
            assert engine.replicas()[0] is not None and engine.replicas()[1] is None  # lost: left out
            for run in runs + later:
                engine.end_run(run)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
