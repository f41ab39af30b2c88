"""What host functions know about the run that is calling them, found through the run's thread.

Host functions get only a store context from wasmtime; each run has its own thread, so a
thread-local is the cheapest correct way to find the run, its services and its resources.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import wasmtime

from host.sandbox.config import SandboxConfig
from host.sandbox.resources import ResourceTable
from host.sandbox.run_io import RunIO
from host.services import Services

_current = threading.local()


@dataclass(slots=True)
class RunState:
    run_id: int
    args: list[str]
    services: Services
    io: RunIO
    config: SandboxConfig
    started_at_s: float
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    resources: ResourceTable = field(default_factory=ResourceTable)
    store: wasmtime.Store | None = None
    # The store context of the host call in progress: handles must be resolved through the
    # call's own context (through the Store, a second borrow in one call trips a wasmtime bug).
    call_context: wasmtime.StoreContext | None = None
    # Why the run was stopped by the host (cancel, budget), kept here because a host function can
    # only raise a bare WasmtimeError across the boundary.
    stop_reason: str | None = None
    stderr_chunks: list[bytes] = field(default_factory=list)
    # Where the run's time goes (benchmarks): host calls made, seconds inside host functions,
    # seconds of those spent waiting for forward passes, and when the first host call came.
    # Updated without a lock: `submit` helpers may add to forward_wait_s concurrently, and a
    # lost update only blurs a statistic.
    num_host_calls: int = 0
    host_call_s: float = 0.0
    forward_wait_s: float = 0.0
    first_host_call_at_s: float = 0.0

    def note_host_call(self, started_s: float) -> None:
        """Account one host call that began at perf_counter `started_s`."""
        if not self.num_host_calls:
            self.first_host_call_at_s = time.monotonic()
        self.num_host_calls += 1
        self.host_call_s += time.perf_counter() - started_s

    def stats(self) -> dict[str, float]:
        return {
            "num_host_calls": float(self.num_host_calls),
            "host_call_s": self.host_call_s,
            "forward_wait_s": self.forward_wait_s,
            "start_to_first_host_call_s": (
                self.first_host_call_at_s - self.started_at_s if self.num_host_calls else float("nan")
            ),
        }

    @property
    def deadline_s(self) -> float:
        return self.started_at_s + self.config.wall_budget_s

    def remaining_s(self) -> float:
        return self.deadline_s - time.monotonic()

    def rearm_watchdog(self) -> None:
        """Give the guest a fresh inactivity window, never past the wall-clock budget."""
        assert self.store is not None
        window_s = min(self.config.inactivity_timeout_s, max(self.remaining_s(), 0.0))
        self.store.set_epoch_deadline(self.config.ticks(window_s))

    def check_can_continue(self) -> None:
        """Stop the guest at a host call if it was cancelled or is out of time."""
        if self.cancel_requested.is_set():
            self.stop_reason = "cancelled"
            raise wasmtime.WasmtimeError("run cancelled")
        if self.remaining_s() <= 0:
            self.stop_reason = f"wall-clock budget of {self.config.wall_budget_s:g} s exhausted"
            raise wasmtime.WasmtimeError(self.stop_reason)


def bind_current(state: RunState | None) -> None:
    _current.state = state


def current() -> RunState:
    state: RunState | None = getattr(_current, "state", None)
    if state is None:
        raise wasmtime.WasmtimeError("host function called outside of a run")
    return state


def current_or_none() -> RunState | None:
    state: RunState | None = getattr(_current, "state", None)
    return state
