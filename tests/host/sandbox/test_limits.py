"""Byte limits of a run (the sandbox's side of `docs/operating.md`, Limits): what a run emits and
sends together is bounded and ends it with LIMIT_EXCEEDED naming the limit; client messages
waiting for a run are bounded and refused past it, and received ones free their share."""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import pytest
from wasmtime.component import Component

from host.sandbox import BufferedRunIO, RunStatus, Sandbox
from host.sandbox.config import MIB
from host.sandbox.errors import InboxFull
from host.sandbox.run_io import Inbox
from tests.host.sandbox.table_services import TableServices


class CountingIO(BufferedRunIO):
    """Keeps only byte counts, so the test itself holds no flood."""

    def __init__(self) -> None:
        super().__init__()
        self.emitted = self.num_sent = 0

    def emit(self, chunk: str) -> None:
        self.emitted += len(chunk)

    def send(self, message: str) -> None:
        self.num_sent += len(message)


@pytest.mark.parametrize("kind", ["emit", "send"])
def test_an_output_flood_ends_at_the_output_limit(
    sandbox: Sandbox, misbehave: Component, services: TableServices, kind: str
) -> None:
    config = dataclasses.replace(sandbox.config, max_output_bytes=8 * MIB)
    io = CountingIO()
    outcome = sandbox.start(misbehave, services, ["flood", kind, "forever"], io=io, config=config).wait(120)
    assert outcome.status is RunStatus.LIMIT_EXCEEDED
    assert outcome.error is not None and "output limit exceeded" in outcome.error
    assert "8388608 bytes" in outcome.error
    assert (io.emitted if kind == "emit" else io.num_sent) == 8 * MIB  # the chunk past it never arrives


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc to read the RSS")
def test_a_flood_kept_by_its_client_ends_at_the_default_limit_and_gives_its_memory_back(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    # As the acceptance has it: an unbounded emit flood (it would reach a GiB in seconds) into a
    # client that keeps every chunk ends at the default 64 MiB, and the process's RSS is back
    # within 100 MiB of where it started once the client lets go.
    gc.collect()
    before = _rss_bytes()
    io = BufferedRunIO()
    outcome = sandbox.start(misbehave, services, ["flood", "emit", "forever"], io=io).wait(120)
    assert outcome.status is RunStatus.LIMIT_EXCEEDED
    assert len(io.output) == 64 * MIB
    del io, outcome
    gc.collect()
    assert _rss_bytes() - before < 100 * MIB


def test_output_under_the_limit_is_all_delivered(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    config = dataclasses.replace(sandbox.config, max_output_bytes=4 * MIB + 64)
    io = CountingIO()
    outcome = sandbox.start(misbehave, services, ["flood", "send", "4"], io=io, config=config).wait(120)
    assert outcome.status is RunStatus.OK, outcome.error
    assert io.num_sent == 4 * MIB and io.emitted == len("flooded 4")


def test_a_spinning_guest_stopped_by_the_wall_clock_is_reported_as_the_wall_clock(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    # The watchdog's window is 30 s here: only the wall clock can have stopped it.
    for _ in range(3):
        config = dataclasses.replace(sandbox.config, wall_budget_s=0.25)
        outcome = sandbox.run(misbehave, services, ["spin"], config=config)
        assert outcome.status is RunStatus.TIMED_OUT
        assert outcome.error == "wall-clock budget of 0.25 s exhausted"


def test_a_cancel_stops_a_guest_spinning_in_wasm(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    """[limits]: a cancel used to wait for the watchdog (the guest makes no host call to stop
    at); the store's epoch-deadline callback now checks for it between host calls too. With a
    10-minute watchdog and wall clock, only the cancel can end these runs."""
    config = dataclasses.replace(sandbox.config, inactivity_timeout_s=600.0, wall_budget_s=600.0)
    for _ in range(3):
        handle = sandbox.start(misbehave, services, ["spin"], config=config)
        time.sleep(0.3)  # well inside the spin
        handle.cancel()
        outcome = handle.wait(timeout_s=60)
        assert outcome.status is RunStatus.CANCELLED and outcome.error == "cancelled"
    assert sandbox.run(misbehave, services, ["decode", "2"]).is_ok  # the sandbox goes on serving


def test_a_guest_that_computes_in_bursts_is_not_stopped_by_the_watchdog(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    """The watchdog's window runs from the last host call: a guest that calls the host between
    bursts of computing shorter than the window is never stopped, however many checks it sees."""
    config = dataclasses.replace(sandbox.config, inactivity_timeout_s=1.0)
    outcome = sandbox.run(misbehave, services, ["bursts", "6", "0.5"], config=config)
    assert outcome.status is RunStatus.OK, outcome.error
    assert outcome.output == "6 bursts"


@pytest.mark.parametrize("kind", ["tokens", "positions"])
def test_input_buffers_of_unexecuted_passes_count_against_the_memory_cap(
    sandbox: Sandbox, misbehave: Component, services: TableServices, kind: str
) -> None:
    # 100k elements a call, charged 36 bytes each: a 32 MiB cap stops the run at the 10th call.
    config = dataclasses.replace(sandbox.config, memory_limit_bytes=32 * MIB)
    outcome = sandbox.run(misbehave, services, ["buffer_inputs", kind, "forever"], config=config)
    assert outcome.status is RunStatus.LIMIT_EXCEEDED
    assert outcome.error is not None and "forward passes hold more than 33554432 bytes" in outcome.error


def test_dropped_passes_give_their_buffers_back(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    # Four times the volume through passes that are dropped as they go never reaches the cap.
    config = dataclasses.replace(sandbox.config, memory_limit_bytes=32 * MIB)
    outcome = sandbox.run(misbehave, services, ["buffer_inputs", "tokens", "40", "release"], config=config)
    assert outcome.status is RunStatus.OK, outcome.error
    assert outcome.output == "buffered 40"


@pytest.mark.parametrize("seconds", ["0.01", "3600"])
def test_a_guest_cannot_sleep_out_of_reach_of_its_limits(
    sandbox: Sandbox, misbehave: Component, services: TableServices, seconds: str
) -> None:
    # A wait inside WASI is outside the watchdog, the wall clock and cancel: refused at once
    # (before, `time.sleep(3600)` held its run for the hour whatever the budget).
    config = dataclasses.replace(sandbox.config, wall_budget_s=2.0)
    outcome = sandbox.run(misbehave, services, ["sleep", seconds], config=config)
    assert outcome.status is RunStatus.TRAPPED
    assert outcome.output == "sleeping"
    assert outcome.error is not None and outcome.error.startswith("inferlets cannot sleep or wait on a clock")
    assert "receive()" in outcome.error


def test_the_clocks_still_read(sandbox: Sandbox, misbehave: Component, services: TableServices) -> None:
    outcome = sandbox.run(misbehave, services, ["clock"])
    assert outcome.status is RunStatus.OK, outcome.error
    assert outcome.output == '{"monotonic": true, "wall": true}'


def test_the_inbox_refuses_messages_past_its_limit_and_frees_received_ones() -> None:
    inbox = Inbox(max_bytes=10)
    inbox.push("12345")
    with pytest.raises(InboxFull, match=r"5 bytes of messages it has not received; this one \(6 bytes\)"):
        inbox.push("ü1234")  # 6 bytes in UTF-8: 11 > 10
    inbox.push("abcde")  # exactly 10
    assert inbox.receive(1) == "12345"
    inbox.push("vwxyz")  # room again
    assert [inbox.receive(1) for _ in range(2)] == ["abcde", "vwxyz"]
    with pytest.raises(InboxFull):
        inbox.push("x" * 11)


def test_the_wall_clock_ends_a_run_waiting_for_a_long_pass(sandbox: Sandbox, misbehave: Component) -> None:
    """A run blocked on a pass that takes a minute (the dummy driver's simulated latency) ends
    at its 1 s wall clock, not when the pass returns (before the wait in slices: 20 s for a 20 s
    pass)."""
    from host.engine import Engine, EngineConfig  # the real engine: the pass waits in it

    config = dataclasses.replace(sandbox.config, wall_budget_s=1.0, inactivity_timeout_s=30.0)
    with Engine.start(EngineConfig("loopback", ["--pass-latency-ms", "60000"])) as engine:
        handle = sandbox.start(misbehave, engine, ["decode_forever"], io=BufferedRunIO(), config=config)
        outcome = handle.wait(30)  # far less than the pass: it ended at its wall clock
    assert outcome.status is RunStatus.TIMED_OUT and "wall-clock budget of 1 s" in (outcome.error or "")
