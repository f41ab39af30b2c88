"""What host functions know about the run that is calling them, found through the run's thread.

Host functions get only a store context from wasmtime; each run has its own thread, so a
thread-local is the cheapest correct way to find the run, its services and its resources.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import wasmtime

from host.sandbox.compute_share import ComputeShare
from host.sandbox.config import SandboxConfig
from host.sandbox.outcome import RunStatus
from host.sandbox.resources import ResourceTable
from host.sandbox.run_io import RunIO, utf8_len
from host.services import Services

_current = threading.local()

# How often a guest computing between host calls is checked (`host.sandbox.watchdog`): a cancel
# or the wall clock stops it within this.
WATCHDOG_CHECK_S = 0.2
# Host calls cheaper than this are not paced; no call waits longer than the second.
_PACE_FROM_S = 0.002
_PACE_MAX_S = 0.5


@dataclass(slots=True)
class RunState:
    run_id: int
    args: list[str]
    services: Services
    io: RunIO
    config: SandboxConfig
    started_at_s: float
    # The inferlet's own sources, for a component on wafer's base (`runtime.app-sources`).
    app_files: tuple[tuple[str, str], ...] = ()
    # Who the run works for (the daemon's API key id; "" for none): shares that span runs, such
    # as the grammar compile workers, are counted by it.
    group: str = ""
    # Guest compute shared out by group (None: not shared); whether this run holds a slot now.
    compute: ComputeShare | None = None
    is_in_guest: bool = False
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    resources: ResourceTable = field(default_factory=ResourceTable)
    store: wasmtime.Store | None = None
    # The store context of the host call in progress: handles must be resolved through the
    # call's own context (through the Store, a second borrow in one call trips a wasmtime bug).
    call_context: wasmtime.StoreContext | None = None
    # Why the run was stopped by the host (cancel, budget, a byte limit) and how to report it,
    # kept here because a host function can only raise a bare WasmtimeError across the boundary.
    stop_reason: str | None = None
    stop_status: RunStatus = RunStatus.TIMED_OUT
    # When the guest last called the host: the inactivity window (watchdog) runs from here.
    last_activity_s: float = 0.0
    output_bytes: int = 0  # emitted and sent so far (UTF-8)
    pass_buffer_bytes: int = 0  # what the host holds for the run's forward passes
    stderr_chunks: list[bytes] = field(default_factory=list)
    # Where the run's time goes (benchmarks): host calls made, seconds inside host functions,
    # seconds of those spent waiting for forward passes, and when the first host call came.
    # Updated without a lock: `submit` helpers may add to forward_wait_s concurrently, and a
    # lost update only blurs a statistic.
    num_host_calls: int = 0
    # Pass requests the run made (a multi-step request is one; a group of n passes is n).
    num_passes: int = 0
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
            "num_passes": float(self.num_passes),
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
        """At each host call: the inactivity window starts again, and the guest's next check
        (`host.sandbox.watchdog`) is at most `WATCHDOG_CHECK_S` away."""
        assert self.store is not None
        self.last_activity_s = time.monotonic()
        self.store.set_epoch_deadline(self.config.ticks(self.next_check_s()))

    def next_check_s(self, check_s: float = 0.0) -> float:
        """Seconds to the guest's next check: `check_s` (default WATCHDOG_CHECK_S), or sooner
        if the wall clock or the inactivity window ends sooner."""
        now = time.monotonic()
        idle_left = self.last_activity_s + self.config.inactivity_timeout_s - now
        return max(0.0, min(check_s or WATCHDOG_CHECK_S, self.deadline_s - now, idle_left))

    def check_while_computing(self) -> str | None:
        """At a check in guest code (no host call in progress): why the run must end now, with
        the reason recorded for its report; None to let the guest go on."""
        ended = self._must_end()
        if ended is not None:
            return str(ended)
        window_s = self.config.inactivity_timeout_s
        if time.monotonic() - self.last_activity_s >= window_s:
            return str(self.stop(f"guest ran {window_s:g} s without calling the host (watchdog)", RunStatus.TIMED_OUT))
        return None

    def stop(self, reason: str, status: RunStatus) -> wasmtime.WasmtimeError:
        """Record why the host ends the run; the error for the host function to raise."""
        self.stop_reason, self.stop_status = reason, status
        return wasmtime.WasmtimeError(reason)

    def charge_pass_buffers(self, num_bytes: int) -> None:
        """Count host-held pass buffers (tokens, positions, mask rows of passes the guest holds)
        against a budget of the run's memory cap: they are the guest's data, kept outside it."""
        self.pass_buffer_bytes += num_bytes
        cap = self.config.memory_limit_bytes
        if self.pass_buffer_bytes > cap:
            raise self._past_limit(
                f"memory limit exceeded: the run's forward passes hold more than {cap} bytes of input on the "
                "host (the run's memory cap; drop or execute passes as you build them)"
            )

    def release_pass_buffers(self, num_bytes: int) -> None:
        self.pass_buffer_bytes -= num_bytes

    def emit(self, text: str) -> None:
        """Deliver output to the client, charged to the output limit (every emit goes here:
        the guest's, and the text host-side generation streams)."""
        self.charge_output(text)
        self.io.emit(text)

    def charge_output(self, text: str) -> None:
        """Count `text` (an emit or a send) against the run's output limit; past it, end the run
        (raised here, and again at the run's next host call, whichever thread charged it)."""
        self.output_bytes += utf8_len(text)
        limit = self.config.max_output_bytes
        if self.output_bytes > limit:
            raise self._past_limit(
                f"output limit exceeded: the run emitted and sent more than {limit} bytes "
                "(the daemon's run_max_output_mib)"
            )

    def _past_limit(self, reason: str) -> wasmtime.WasmtimeError:
        return self.stop(reason, RunStatus.LIMIT_EXCEEDED)

    def enter_guest(self) -> None:
        """Before guest code runs (instantiation, the return from a host call): a slot of the
        run's group, waiting in line for one; raises if the run must stop meanwhile."""
        if self.compute is None or not self.group or self.is_in_guest:
            return
        waiting_since_s = time.monotonic()
        self.compute.enter(self.group, self.check_can_continue)
        self.is_in_guest = True
        # Waiting for a turn is not guest time: the watchdog's window does not run meanwhile.
        self.last_activity_s += time.monotonic() - waiting_since_s

    def leave_guest(self) -> None:
        """Guest code stops (a host call, the run's end): the slot goes to whoever waits."""
        if self.is_in_guest:
            assert self.compute is not None
            self.is_in_guest = False
            self.compute.leave(self.group)

    def pace(self, cpu_s: float) -> None:
        """After a host call that took `cpu_s` of this thread's CPU (building and queueing a
        group of passes, say): while runs of other groups are live, wait `cpu_s` (times the
        config's `host_pacing`) for each such group before going on, so one key's host work
        takes about its share of the interpreter every thread needs, not all of it. A run
        alone, or a cheap call, is not paced."""
        if cpu_s < _PACE_FROM_S or self.compute is None or not self.group or not self.config.host_pacing:
            return
        others = self.compute.num_other_groups(self.group)
        if others:
            time.sleep(min(self.config.host_pacing * others * cpu_s, _PACE_MAX_S))

    def yield_guest(self) -> None:
        """At a check while computing: another run of the group waits, so this one goes to the
        back of the line."""
        if self.is_in_guest and self.compute is not None and self.compute.has_waiters(self.group):
            self.leave_guest()
            self.enter_guest()

    def check_can_continue(self) -> None:
        """Stop the guest at a host call if it was cancelled or is out of time."""
        ended = self._must_end()
        if ended is not None:
            raise ended

    def _must_end(self) -> wasmtime.WasmtimeError | None:
        """The error that ends the run now (a cancel, the wall clock, a limit charged on
        another thread), its reason recorded; None if it may go on."""
        if self.cancel_requested.is_set():
            self.stop_reason = "cancelled"
            return wasmtime.WasmtimeError("run cancelled")
        if self.remaining_s() <= 0:
            return self.stop(f"wall-clock budget of {self.config.wall_budget_s:g} s exhausted", RunStatus.TIMED_OUT)
        if self.stop_reason is not None and self.stop_status is RunStatus.LIMIT_EXCEEDED:
            return wasmtime.WasmtimeError(self.stop_reason)  # passed off the run's thread
        return None


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
