"""Runs started over HTTP: admission (the concurrent-run limit), the sandbox start on the live
engine, state, cancellation, draining at shutdown, and which finished runs are kept (bounded by
count and by bytes, per API key and in all).

It knows the sandbox and the supervisor; it knows nothing of HTTP or of the OpenAI API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio.to_thread

from host.daemon.config import DaemonConfig
from host.daemon.errors import DriverUnavailable, NotFound, PagesExhausted, TooManyRuns
from host.daemon.logs import request_id_var
from host.daemon.metrics import BoundedCounts
from host.daemon.replica_set import AnyEngine, ReplicaSet
from host.daemon.run_log import RunLog, bounded_text, end_event_bytes
from host.sandbox import LoadedInferlet, RunHandle, RunOutcome, RunStatus, Sandbox
from host.sandbox.config import MIB

log = logging.getLogger("wafer.daemon.runs")

T = TypeVar("T")

# Inferlets counted by name in `ended_by_inferlet` (for /metrics); any past these count as "other",
# so uploads cannot grow the metric's series without bound.
MAX_INFERLET_SERIES = 64


class RunState(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


_STATE_OF = {
    RunStatus.OK: RunState.SUCCEEDED,
    RunStatus.GUEST_ERROR: RunState.FAILED,
    RunStatus.TRAPPED: RunState.FAILED,
    RunStatus.TIMED_OUT: RunState.TIMED_OUT,
    RunStatus.LIMIT_EXCEEDED: RunState.FAILED,
    RunStatus.CANCELLED: RunState.CANCELLED,
}


@dataclass(slots=True)
class RunRecord:
    run_id: int
    inferlet: str
    kind: str  # "inferlet" (started by a client) or "chat" (serving an OpenAI request)
    generation: int  # the engine generation it runs on (see Supervisor)
    created_at: float
    # While it runs; dropped at its end, with all the run held (its args, its inferlet's sources).
    handle: RunHandle | None
    log: RunLog
    # While it runs: the inferlet it runs. Its sources live as long as some run of it, so every
    # run started meanwhile gets the same copy (see `InferletStore.load`).
    loaded: LoadedInferlet | None = None
    outcome: RunOutcome | None = None
    owner: str = ""  # digest of the API key that started it: only that key sees the run
    request_id: str = ""  # of the HTTP request that started it (for the logs of its end)
    driver_lost: str = ""  # set when the driver died under the run
    is_cancel_requested: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.is_cancel_requested = True
        handle = self.handle
        if handle is not None:
            handle.cancel()

    @property
    def state(self) -> RunState:
        if self.outcome is None:
            return RunState.RUNNING
        # A cancelled guest may see its pending pass fail and return that error before the
        # sandbox stops it at a host call: after a cancel, any failure is the cancel.
        if self.is_cancel_requested and not self.outcome.is_ok and self.outcome.status is not RunStatus.TIMED_OUT:
            return RunState.CANCELLED
        return _STATE_OF[self.outcome.status]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.run_id,
            "object": "run",
            "inferlet": self.inferlet,
            "kind": self.kind,
            "state": self.state.value,
            "created": int(self.created_at),
        }
        if self.outcome is not None:
            out["error"] = self.error_message()
        return out

    def error_message(self) -> str | None:
        if self.outcome is None or self.outcome.is_ok:
            return None
        if self.state is RunState.CANCELLED:
            return "cancelled"
        error = self.outcome.error or self.outcome.status.value
        if self.driver_lost:
            return f"{error} (the model driver failed: {bounded_text(self.driver_lost, 1024)})"
        return error


class RunRegistry:
    def __init__(self, config: DaemonConfig, sandbox: Sandbox, supervisor: ReplicaSet) -> None:
        self._config = config
        self._sandbox = sandbox
        self._supervisor = supervisor
        self._lock = threading.Lock()
        self._runs: OrderedDict[int, RunRecord] = OrderedDict()
        # The kept finished runs, in the order they ended, with the bytes each holds: all of
        # them, and each key's.
        self._finished: OrderedDict[int, int] = OrderedDict()
        self._finished_bytes = 0
        self._finished_of: dict[str, OrderedDict[int, int]] = {}
        self._finished_bytes_of: dict[str, int] = {}
        self._num_running = 0
        self._running_of: dict[str, int] = {}  # API key digest -> its runs running
        self._num_ended: dict[RunState, int] = dict.fromkeys(RunState, 0)
        self._ended_by = BoundedCounts(MAX_INFERLET_SERIES)  # (inferlet, final state) -> runs
        self._is_draining = False
        self._run_config = config.sandbox_config()

    # ------------------------------------------------------------------ starting

    async def start(
        self,
        inferlet_code: LoadedInferlet,
        inferlet: str,
        kind: str,
        engine_wait_s: float,
        prepare: Callable[[AnyEngine], tuple[Sequence[str], T]],
        owner: str = "",
    ) -> tuple[RunRecord, T]:
        """Start a run, all in one worker thread: wait up to `engine_wait_s` for a (re)starting
        driver, admit it (the concurrent-run limit, before any work for it), build the run's
        args on the live engine with `prepare` (which may refuse the request: then its slot is
        given back) and start it.
        One hop, and nothing that blocks (a thread start, instantiating the component) on the
        event loop, which serves every open stream. Returns the run and what `prepare` made."""
        loop = asyncio.get_running_loop()
        request_id = request_id_var.get()

        def launch() -> tuple[RunRecord, T]:
            engine, generation = self._supervisor.engine(engine_wait_s)
            if engine.num_available_pages == 0:
                raise PagesExhausted(engine.num_pages)
            # A run slot first: preparing may compile a grammar (seconds of host CPU), which a
            # request must not get when every slot is busy.
            self._admit(owner)
            try:
                args, prepared = prepare(engine)
                run_log = RunLog(f"a {kind} run", loop, self._run_config.max_inbound_bytes)
                handle = self._sandbox.start(
                    inferlet_code,
                    engine,
                    list(args),
                    io=run_log,
                    config=self._run_config,
                    on_run_id=lambda run_id: engine.set_run_group(run_id, owner),  # the key's page share
                    group=owner,
                )
            except BaseException:
                with self._lock:
                    self._release_slot(owner)
                raise
            record = RunRecord(
                handle.run_id, inferlet, kind, generation, time.time(), handle, run_log, inferlet_code, owner=owner
            )
            record.request_id = request_id
            self._track(record)
            return record, prepared

        return await anyio.to_thread.run_sync(launch)

    def _admit(self, owner: str) -> None:
        """A run slot for `owner`'s run: within all slots and the key's own limit; the last
        `key_reserve_run_slots` only for a key with no run running, so runs that wait long (in
        receive(), say) cannot have every other key's requests refused. With one key or none,
        every slot is that key's."""
        config = self._config
        with self._lock:
            if self._is_draining:
                raise DriverUnavailable("the daemon is shutting down")
            if self._num_running >= config.max_concurrent_runs:
                raise TooManyRuns(config.max_concurrent_runs)
            mine = self._running_of.get(owner, 0)
            if len(config.api_keys) > 1:
                self._check_key_share(mine)
            self._num_running += 1
            self._running_of[owner] = mine + 1

    def _check_key_share(self, mine: int) -> None:
        """TooManyRuns if a key running `mine` runs may not take another slot; lock held."""
        config = self._config
        if mine >= config.key_max_concurrent_runs:
            raise TooManyRuns(config.key_max_concurrent_runs, "key_max_concurrent_runs")
        reserve = min(config.key_reserve_run_slots, config.max_concurrent_runs - 1)
        if mine and self._num_running >= config.max_concurrent_runs - reserve:
            raise TooManyRuns(config.max_concurrent_runs - reserve, "key_reserve_run_slots")

    def _release_slot(self, owner: str) -> None:
        """Give a run slot back; lock held."""
        self._num_running -= 1
        self._running_of[owner] -= 1
        if not self._running_of[owner]:
            del self._running_of[owner]

    def _track(self, record: RunRecord) -> None:
        """Keep a started run, and watch for its end."""
        with self._lock:
            self._runs[record.run_id] = record
        threading.Thread(
            target=self._await_end, args=(record,), name=f"wafer-run-{record.run_id}-end", daemon=True
        ).start()
        extra = {"run_id": record.run_id, "request_id": record.request_id}
        log.info("run %d started (%s %s)", record.run_id, record.kind, record.inferlet, extra=extra)

    def _await_end(self, record: RunRecord) -> None:
        assert record.handle is not None
        outcome = record.handle.wait()
        if not outcome.is_ok and outcome.status is not RunStatus.CANCELLED and not record.is_cancel_requested:
            record.driver_lost = self._supervisor.lost_reason(record.generation, record.run_id)
        # Kept: the error, bounded. Not kept: the output (the run log has it) and stderr (a
        # trap's error carries its tail already), nor the run itself.
        error = bounded_text(outcome.error) if outcome.error is not None else None
        record.outcome = dataclasses.replace(outcome, output="", stderr="", error=error)
        record.handle = record.loaded = None
        end = record.describe()
        with self._lock:
            self._release_slot(record.owner)
            self._num_ended[record.state] += 1
            self._ended_by.add(record.inferlet, record.state.value)
            # Counted with its end event, and kept or forgotten before a follower sees that event.
            self._keep_finished(record, record.log.num_bytes + end_event_bytes(end))
        record.log.end(end)
        record.done.set()
        log.info(
            "run %d ended: %s%s",
            record.run_id,
            record.state.value,
            f" ({record.error_message()})" if record.error_message() else "",
            extra={"run_id": record.run_id, "request_id": record.request_id},
        )

    def _keep_finished(self, record: RunRecord, size: int) -> None:
        """Keep a run that ended, then forget the runs that ended first while its key's kept
        runs, or all kept runs, pass their count or byte bound (without a scan of every run at
        every end); lock held. Its own follower goes on reading its log either way."""
        owner, config = record.owner, self._config
        mine = self._finished_of.setdefault(owner, OrderedDict())
        mine[record.run_id] = size
        self._finished_bytes_of[owner] = self._finished_bytes_of.get(owner, 0) + size
        self._finished[record.run_id] = size
        self._finished_bytes += size
        max_key_bytes = config.key_max_kept_run_mib * MIB
        while mine and (len(mine) > config.key_max_kept_runs or self._finished_bytes_of[owner] > max_key_bytes):
            self._forget(next(iter(mine)))
        max_bytes = config.max_kept_run_mib * MIB
        while self._finished and (len(self._finished) > config.max_kept_runs or self._finished_bytes > max_bytes):
            self._forget(next(iter(self._finished)))

    def _forget(self, run_id: int) -> None:
        record = self._runs.pop(run_id)
        size = self._finished.pop(run_id)
        self._finished_bytes -= size
        mine = self._finished_of[record.owner]
        del mine[run_id]
        self._finished_bytes_of[record.owner] -= size
        if not mine:
            del self._finished_of[record.owner], self._finished_bytes_of[record.owner]

    # ------------------------------------------------------------------ queries and control

    def get(self, run_id: int, owner: str | None = None) -> RunRecord:
        """The run; with `owner`, only a run that key started (any other is "not found")."""
        with self._lock:
            record = self._runs.get(run_id)
        if record is None or (owner is not None and record.owner != owner):
            raise NotFound(f"no run {run_id}", param="run_id", code="run_not_found")
        return record

    def list(
        self, kind: str | None = None, owner: str | None = None, after: int = -1, limit: int | None = None
    ) -> list[RunRecord]:
        """Runs by id: of `kind` and `owner` (None: any), with ids past `after`, at most `limit`."""
        with self._lock:
            found = [
                r
                for r in self._runs.values()
                if r.run_id > after and (kind is None or r.kind == kind) and (owner is None or r.owner == owner)
            ]
        found.sort(key=lambda r: r.run_id)  # a run is kept once started, which is not in id order
        return found if limit is None else found[:limit]

    def counts(self) -> dict[str, int]:
        """Runs now running, and runs ended so far by final state (for /metrics)."""
        with self._lock:
            out = {state.value: n for state, n in self._num_ended.items()}
            out[RunState.RUNNING.value] = self._num_running
            return out

    def ended_by_inferlet(self) -> dict[tuple[str, ...], int]:
        """Runs ended so far by (inferlet, final state), the first MAX_INFERLET_SERIES inferlets
        by name and the rest as "other" (for /metrics)."""
        with self._lock:
            return self._ended_by.counts()

    @property
    def num_running(self) -> int:
        with self._lock:
            return self._num_running

    def drain(self, timeout_s: float) -> None:
        """Refuse new runs, let running ones finish for `timeout_s`, then cancel the rest."""
        with self._lock:
            self._is_draining = True
            running = [r for r in self._runs.values() if r.outcome is None]
        deadline = time.monotonic() + timeout_s
        for record in running:
            record.done.wait(max(0.0, deadline - time.monotonic()))
        leftover = [r for r in running if not r.done.is_set()]
        for record in leftover:
            log.warning("run %d still running at shutdown: cancelling it", record.run_id)
            record.cancel()
        for record in leftover:
            record.done.wait(5.0)
