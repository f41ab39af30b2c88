"""`wafer dev`'s engines (host.cli.dev_engines) on real dummy driver processes: a driver killed
between runs is restarted before the next one, alone or as one replica of two; a lost kept
driver is replaced by a fresh one; a driver that cannot come back leaves the others serving."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bridge_schema.batch import OutputSpec, Sampler
from host.cli.dev_engines import DevEngines
from host.engine import Engine, EngineConfig, ReplicatedEngine
from host.services import PassRequest
from tests.listening import wait_until_listening

ARGS = ("--num-pages", "64", "--page-size", "4")
_runs = itertools.count(1)


def _serves(engine: Engine | ReplicatedEngine) -> int:
    """Which replica a new run's pass ran on (0 for a single engine): the pass succeeded."""
    run = next(_runs)
    ctx = engine.create_context(run)
    engine.forward(run, ctx, PassRequest(tokens=[1, 2, 3], outputs=[OutputSpec(2, Sampler())]))
    placed = engine.placement(run) if isinstance(engine, ReplicatedEngine) else (0, 0)
    engine.end_run(run)
    assert placed is not None
    return placed[0]


def _kill(engine: Engine) -> int:
    pid = int(engine.driver_health()["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_lost_driver_is_restarted_before_the_next_run() -> None:
    said: list[str] = []
    with DevEngines.start([EngineConfig("dummy", ARGS)], said.append) as engines:
        first = engines.for_next_run()
        assert isinstance(first, Engine) and not said
        _serves(first)
        old_pid = _kill(first)
        second = engines.for_next_run()
        assert isinstance(second, Engine) and second is not first
        assert int(second.driver_health()["pid"]) != old_pid
        _serves(second)
        assert engines.generations == [2]
        assert said[0].startswith("the driver (dummy) was lost (") and said[0].endswith("): restarting it")
        assert said[1:] == ["the driver (dummy) restarted"]
        assert engines.for_next_run() is second  # a healthy driver is kept
        assert len(said) == 2


def test_a_lost_replica_is_restarted_and_both_serve_again() -> None:
    said: list[str] = []
    configs = [EngineConfig("dummy", ARGS) for _ in range(2)]
    with DevEngines.start(configs, said.append) as engines:
        engine = engines.for_next_run()
        assert isinstance(engine, ReplicatedEngine)
        replicas = engine.replicas()
        assert replicas[1] is not None
        _kill(replicas[1])
        assert engines.for_next_run() is engine  # the same replicated engine, its replica replaced
        assert engines.generations == [1, 2]
        assert [s for s in said if "restart" in s][-1] == "replica 1 (dummy) restarted"
        # Runs go to the replica with the fewest: four in a row, held open, land on both.
        runs = [next(_runs) for _ in range(4)]
        for run in runs:
            ctx = engine.create_context(run)
            engine.forward(run, ctx, PassRequest(tokens=[5, 6], outputs=[OutputSpec(1, Sampler())]))
        placed = [engine.placement(run) for run in runs]
        for run in runs:
            engine.end_run(run)
        assert sorted({p[0] for p in placed if p is not None}) == [0, 1]
        assert (1, 2) in placed  # the restarted driver (generation 2) served


def _outside_driver(tmp: str) -> tuple[subprocess.Popen[bytes], str]:
    """A dummy driver started by the test (as `wafer driver start` keeps one), listening."""
    address = f"unix:{Path(tmp) / 'd.sock'}"
    proc = subprocess.Popen([sys.executable, "-m", "drivers.dummy", "--listen", address, *ARGS])
    wait_until_listening(Path(tmp) / "d.sock", proc, 60)
    return proc, address


def test_a_lost_kept_driver_is_replaced_by_a_fresh_one() -> None:
    """`wafer dev` on a kept driver (`wafer driver start`): once it is gone and its address cannot
    be reached, a fresh driver of the same kind is started, and later restarts start fresh ones."""
    said: list[str] = []
    with tempfile.TemporaryDirectory(prefix="wafer-dev-") as tmp:
        kept, address = _outside_driver(tmp)
        try:
            with DevEngines.start([EngineConfig(address)], said.append, [EngineConfig("dummy", ARGS)]) as engines:
                first = engines.for_next_run()
                assert first is not None
                kept.kill()
                kept.wait()
                second = engines.for_next_run()
                assert isinstance(second, Engine) and second.config.driver == "dummy"
                _serves(second)
                assert said[-2].startswith(f"the driver ({address}) cannot be reached (")
                assert said[-2].endswith("): starting a dummy driver instead")
                assert said[-1] == "the driver (dummy) restarted"
                _kill(second)
                third = engines.for_next_run()  # the fresh one's own restart
                assert isinstance(third, Engine) and third is not second
                _serves(third)
                assert said[-1] == "the driver (dummy) restarted" and engines.generations == [3]
        finally:
            if kept.poll() is None:
                kept.kill()
                kept.wait()


def test_a_replica_that_cannot_come_back_leaves_the_other_serving() -> None:
    """A driver at an address (started elsewhere) that died cannot be restarted from here: the
    run goes on the replica that is up, and the restart is tried again before the next run."""
    said: list[str] = []
    with tempfile.TemporaryDirectory(prefix="wafer-dev-") as tmp:
        outside, address = _outside_driver(tmp)
        try:
            configs = [EngineConfig("dummy", ARGS), EngineConfig(address)]
            with DevEngines.start(configs, said.append) as engines:
                outside.kill()
                outside.wait()
                engine = engines.for_next_run()
                assert engine is not None
                assert engine.replicas()[1] is None  # type: ignore[union-attr]
                assert {_serves(engine) for _ in range(3)} == {0}
                assert engines.for_next_run() is engine
                restarts = [s for s in said if "did not restart" in s]
                assert len(restarts) == 2 and restarts[0].startswith(f"replica 1 ({address}) did not restart (")
                assert engines.generations == [1, 1]
        finally:
            if outside.poll() is None:
                outside.kill()
                outside.wait()
