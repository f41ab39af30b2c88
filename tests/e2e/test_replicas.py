"""Real inferlets that fork (parallel_generation, beam_search) on two dummy driver replicas:
runs spread over both, every run's forks on its replica, nothing left held."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from host.engine import EngineConfig, ReplicatedEngine
from host.sandbox import Sandbox


@pytest.fixture(scope="module")
def pair() -> Iterator[ReplicatedEngine]:
    configs = [EngineConfig("dummy", ("--num-pages", "1024", "--page-size", "16"), speculation_depth=1)] * 2
    with ReplicatedEngine.start(configs) as engine:
        yield engine


def test_forking_inferlets_run_on_both_replicas(
    pair: ReplicatedEngine, sandbox: Sandbox, built: dict[str, Path]
) -> None:
    parallel, beam = sandbox.load(built["parallel_generation"]), sandbox.load(built["beam_search"])
    handles = [
        sandbox.start(parallel, pair, ["--prompt", f"story {i} " * 8, "--branches", "3", "--max-tokens", "8"])
        for i in range(4)
    ]
    handles += [sandbox.start(beam, pair, ["--prompt", f"beam {i} " * 8, "--max-tokens", "6"]) for i in range(2)]
    outcomes = [h.wait() for h in handles]
    assert all(o.is_ok for o in outcomes), [o.error for o in outcomes if not o.is_ok]
    assert all(o.held_pages == 0 for o in outcomes)
    placed = [pair.placement(h.run_id) for h in handles]
    assert {p[0] for p in placed if p is not None} == {0, 1} and None not in placed
    assert pair.num_available_pages == pair.num_pages
