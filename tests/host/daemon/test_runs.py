"""The run registry, on a fake sandbox: its start is one worker-thread hop that prepares, admits
and starts a run, with nothing blocking on the event loop (which serves every open stream); it
forgets the runs that ended first; a finished run keeps only its log and a bounded error."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from host.daemon.config import load_config
from host.daemon.errors import BadRequest, TooManyRuns
from host.daemon.run_log import MAX_ERROR_BYTES
from host.daemon.runs import RunRecord, RunRegistry
from host.sandbox import RunOutcome, RunStatus


class FakeHandle:
    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        self.finish = threading.Event()
        self.outcome = RunOutcome(run_id, RunStatus.CANCELLED, "")

    def wait(self, timeout_s: float | None = None) -> RunOutcome:
        self.finish.wait(timeout_s)
        return self.outcome

    def cancel(self) -> None:
        self.finish.set()


class FakeSandbox:
    """Records the thread each start ran on; its runs never end until cancelled."""

    def __init__(self) -> None:
        self.start_threads: list[threading.Thread] = []
        self.handles: list[FakeHandle] = []

    def start(
        self,
        component: Any,
        engine: Any,
        args: list[str],
        io: Any,
        config: Any,
        on_run_id: Any = None,
        group: str = "",
    ) -> FakeHandle:
        self.start_threads.append(threading.current_thread())
        self.handles.append(FakeHandle(len(self.handles) + 1))
        if on_run_id is not None:
            on_run_id(self.handles[-1].run_id)
        return self.handles[-1]


class FakeEngine:
    num_available_pages = 8
    num_pages = 8
    groups: dict[int, str] = {}  # noqa: RUF012 - one per test process, read by one test

    def set_run_group(self, run_id: int, group: str) -> None:
        self.groups[run_id] = group

    def __str__(self) -> str:
        return "the engine"


class FakeSupervisor:
    def __init__(self) -> None:
        self.engine_threads: list[threading.Thread] = []

    def engine(self, timeout_s: float = 0.0) -> tuple[FakeEngine, int]:
        self.engine_threads.append(threading.current_thread())
        return FakeEngine(), 7

    def lost_reason(self, generation: int, run_id: int) -> str:
        return ""


def registry(max_runs: int, **limits: int) -> tuple[RunRegistry, FakeSandbox, FakeSupervisor]:
    config = load_config({"max_concurrent_runs": max_runs, **limits}, environ={})
    sandbox, supervisor = FakeSandbox(), FakeSupervisor()
    return RunRegistry(config, sandbox, supervisor), sandbox, supervisor  # type: ignore[arg-type]


def test_start_prepares_and_starts_off_the_event_loop() -> None:
    runs, sandbox, supervisor = registry(4)
    prepare_threads: list[threading.Thread] = []

    def prepare(engine: Any) -> tuple[list[str], str]:
        prepare_threads.append(threading.current_thread())
        return ["--arg"], f"prepared on {engine}"

    async def scenario() -> tuple[RunRecord, str, threading.Thread]:
        record, prepared = await runs.start(object(), "chat", "chat", 1.0, prepare, owner="k")
        return record, prepared, threading.current_thread()

    record, prepared, loop_thread = asyncio.run(scenario())
    assert prepared == "prepared on the engine"
    assert (record.run_id, record.generation, record.owner) == (1, 7, "k")
    assert FakeEngine.groups[1] == "k"  # the run counts against its key's share of the pages
    # One hop: the engine wait, the preparation and the start ran on the same worker thread.
    threads = {*supervisor.engine_threads, *prepare_threads, *sandbox.start_threads}
    assert len(threads) == 1 and loop_thread not in threads
    record.cancel()
    assert record.done.wait(5)


def test_the_run_limit_comes_before_preparation_and_a_refused_one_admits_nothing() -> None:
    runs, sandbox, _ = registry(1)

    def refuse(_engine: Any) -> tuple[list[str], None]:
        raise BadRequest("bad request")

    def accept(_engine: Any) -> tuple[list[str], None]:
        return [], None

    async def scenario() -> RunRecord:
        with pytest.raises(BadRequest):
            await runs.start(object(), "chat", "chat", 1.0, refuse)
        assert runs.num_running == 0 and sandbox.handles == []
        record, _ = await runs.start(object(), "chat", "chat", 1.0, accept)
        # At the limit nothing is prepared (a grammar compile is host CPU): a 429 at once.
        prepared: list[object] = []

        def spy(engine: Any) -> tuple[list[str], None]:
            prepared.append(engine)
            raise BadRequest("bad request")

        with pytest.raises(TooManyRuns):
            await runs.start(object(), "chat", "chat", 1.0, spy)
        assert prepared == []
        with pytest.raises(TooManyRuns):
            await runs.start(object(), "chat", "chat", 1.0, accept)
        return record

    record = asyncio.run(scenario())
    assert runs.num_running == 1
    record.cancel()
    assert record.done.wait(5)
    assert runs.num_running == 0


def _accept(_engine: Any) -> tuple[list[str], None]:
    return [], None


def test_the_runs_that_ended_first_are_forgotten_first() -> None:
    runs, _, _ = registry(8, max_kept_runs=2)

    async def scenario() -> list[RunRecord]:
        return [(await runs.start(object(), "chat", "chat", 1.0, _accept))[0] for _ in range(5)]

    records = asyncio.run(scenario())
    for i in (3, 0, 4, 1):  # the order they end in
        records[i].cancel()
        assert records[i].done.wait(5)
    # Kept: the two that ended last, and the one still running.
    assert sorted(r.run_id for r in runs.list()) == sorted(records[i].run_id for i in (4, 1, 2))
    assert [r.run_id for r in runs.list(after=records[1].run_id, limit=1)] == [records[2].run_id]
    records[2].cancel()
    assert records[2].done.wait(5)


def test_a_finished_run_keeps_its_log_and_a_bounded_error_and_lets_go_of_the_rest() -> None:
    runs, sandbox, _ = registry(2)

    async def scenario() -> RunRecord:
        return (await runs.start(object(), "chat", "chat", 1.0, _accept))[0]

    record = asyncio.run(scenario())
    assert record.handle is not None and record.loaded is not None
    sandbox.handles[0].outcome = RunOutcome(
        record.run_id, RunStatus.GUEST_ERROR, output="o" * 10_000, error="é" * 100_000, stderr="s" * 10_000
    )
    sandbox.handles[0].finish.set()
    assert record.done.wait(5)
    assert record.outcome is not None and record.outcome.output == record.outcome.stderr == ""
    assert record.handle is None and record.loaded is None  # the run, its args and its sources
    error = record.error_message()
    assert error is not None and error.endswith(f"... ({200_000 - MAX_ERROR_BYTES} bytes more)")
    assert len(error.encode()) < MAX_ERROR_BYTES + 40 and record.describe()["error"] == error


def test_one_key_cannot_take_every_run_slot() -> None:
    """Runs that wait long (in receive(), say) held every slot: eight of one key made every
    other key's requests 429. A key runs at most key_max_concurrent_runs, and the last
    key_reserve_run_slots go only to keys with no run running."""
    runs, _, _ = registry(10, api_keys=["a", "b", "c", "d", "e"], key_max_concurrent_runs=6, key_reserve_run_slots=3)  # type: ignore[list-item]

    async def start(owner: str) -> RunRecord:
        return (await runs.start(object(), "chat", "chat", 1.0, _accept, owner=owner))[0]

    async def scenario() -> list[RunRecord]:
        started = [await start("a") for _ in range(6)]
        with pytest.raises(TooManyRuns, match=r"this API key has 6 runs running.*key_max_concurrent_runs"):
            await start("a")
        started.append(await start("b"))  # 7 of 10: the rest is the reserve
        with pytest.raises(
            TooManyRuns, match=r"7 run slots are busy.*kept for other API keys \(key_reserve_run_slots\)"
        ):
            await start("b")
        started += [await start(key) for key in ("c", "d", "e")]  # each with none running
        with pytest.raises(TooManyRuns, match="all 10 run slots are busy"):
            await start("a")
        return started

    started = asyncio.run(scenario())
    for record in started:
        record.cancel()
        assert record.done.wait(5)
    assert runs.num_running == 0
    alone, _, _ = registry(2, api_keys=["a"], key_max_concurrent_runs=1)  # type: ignore[list-item]

    async def single_key() -> list[RunRecord]:  # with one key, every slot is its own
        return [(await alone.start(object(), "chat", "chat", 1.0, _accept, owner="a"))[0] for _ in range(2)]

    for record in asyncio.run(single_key()):
        record.cancel()
        assert record.done.wait(5)
