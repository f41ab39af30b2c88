"""Runs started over HTTP: admission (the concurrent-run limit), the sandbox start on the live
engine, state, cancellation, and draining at shutdown.

It knows the sandbox and the supervisor; it knows nothing of HTTP or of the OpenAI API.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio.to_thread

from host.daemon.config import DaemonConfig
from host.daemon.errors import DriverUnavailable, NotFound, PagesExhausted, TooManyRuns
from host.daemon.logs import request_id_var
from host.daemon.replica_set import AnyEngine, ReplicaSet
from host.daemon.run_log import RunLog
from host.sandbox import LoadedInferlet, RunHandle, RunOutcome, RunStatus, Sandbox

log = logging.getLogger("wafer.daemon.runs")

T = TypeVar("T")

MAX_KEPT_FINISHED = 256  # finished runs kept for `GET /v1/runs` and late followers


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
    handle: RunHandle
    log: RunLog
    outcome: RunOutcome | None = None
    owner: str = ""  # digest of the API key that started it: only that key sees the run
    request_id: str = ""  # of the HTTP request that started it (for the logs of its end)
    driver_lost: str = ""  # set when the driver died under the run
    is_cancel_requested: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.is_cancel_requested = True
        self.handle.cancel()

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
        return f"{error} (the model driver failed: {self.driver_lost})" if self.driver_lost else error


class RunRegistry:
    def __init__(self, config: DaemonConfig, sandbox: Sandbox, supervisor: ReplicaSet) -> None:
        self._config = config
        self._sandbox = sandbox
        self._supervisor = supervisor
        self._lock = threading.Lock()
        self._runs: OrderedDict[int, RunRecord] = OrderedDict()
        self._finished: deque[int] = deque()  # ids of the kept finished runs, in the order they ended
        self._num_running = 0
        self._num_ended: dict[RunState, int] = dict.fromkeys(RunState, 0)
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
            self._admit()
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
                )
            except BaseException:
                with self._lock:
                    self._num_running -= 1
                raise
            record = RunRecord(handle.run_id, inferlet, kind, generation, time.time(), handle, run_log, owner=owner)
            record.request_id = request_id
            self._track(record)
            return record, prepared

        return await anyio.to_thread.run_sync(launch)

    def _admit(self) -> None:
        with self._lock:
            if self._is_draining:
                raise DriverUnavailable("the daemon is shutting down")
            if self._num_running >= self._config.max_concurrent_runs:
                raise TooManyRuns(self._config.max_concurrent_runs)
            self._num_running += 1

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
        outcome = record.handle.wait()
        if not outcome.is_ok and outcome.status is not RunStatus.CANCELLED and not record.is_cancel_requested:
            record.driver_lost = self._supervisor.lost_reason(record.generation, record.run_id)
        record.outcome = outcome
        with self._lock:
            self._num_running -= 1
            self._num_ended[record.state] += 1
            self._finished.append(record.run_id)
            self._evict_finished()
        record.log.end(record.describe())
        record.done.set()
        log.info(
            "run %d ended: %s%s",
            record.run_id,
            record.state.value,
            f" ({record.error_message()})" if record.error_message() else "",
            extra={"run_id": record.run_id, "request_id": record.request_id},
        )

    def _evict_finished(self) -> None:
        """Forget the runs that ended first, past the last MAX_KEPT_FINISHED (without a scan of
        every run at every end)."""
        while len(self._finished) > MAX_KEPT_FINISHED:
            del self._runs[self._finished.popleft()]

    # ------------------------------------------------------------------ queries and control

    def get(self, run_id: int, owner: str | None = None) -> RunRecord:
        """The run; with `owner`, only a run that key started (any other is "not found")."""
        with self._lock:
            record = self._runs.get(run_id)
        if record is None or (owner is not None and record.owner != owner):
            raise NotFound(f"no run {run_id}", param="run_id", code="run_not_found")
        return record

    def list(self, kind: str | None = None, owner: str | None = None) -> list[RunRecord]:
        with self._lock:
            return [
                r
                for r in self._runs.values()
                if (kind is None or r.kind == kind) and (owner is None or r.owner == owner)
            ]

    def counts(self) -> dict[str, int]:
        """Runs now running, and runs ended so far by final state (for /metrics)."""
        with self._lock:
            out = {state.value: n for state, n in self._num_ended.items()}
            out[RunState.RUNNING.value] = self._num_running
            return out

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
