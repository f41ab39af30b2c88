"""What a guest cannot do: spin forever, allocate without bound, recurse without bound, touch
files, environment or sockets. The host survives each and runs the next inferlet normally."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from wasmtime.component import Component

from host.sandbox import RunStatus, Sandbox
from host.sandbox.config import MIB
from tests.host.sandbox.table_services import TableServices


def _assert_host_still_serves(sandbox: Sandbox, component: Component, services: TableServices) -> None:
    outcome = sandbox.run(component, services, ["decode", "3"])
    assert outcome.status is RunStatus.OK, outcome.error
    assert outcome.output == "71,72,73"


def test_spinning_guest_is_trapped_while_other_runs_keep_going(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    watchdog = dataclasses.replace(sandbox.config, inactivity_timeout_s=0.3)
    spinner = sandbox.start(misbehave, services, ["spin"], config=watchdog)
    others = [sandbox.start(misbehave, services, ["decode", "40"]) for _ in range(4)]
    for handle in others:
        outcome = handle.wait(timeout_s=120)
        assert outcome.status is RunStatus.OK, outcome.error
        assert outcome.output.split(",")[:2] == ["71", "72"]
    outcome = spinner.wait(timeout_s=120)
    assert outcome.status is RunStatus.TIMED_OUT
    assert "without calling the host" in (outcome.error or "")
    _assert_host_still_serves(sandbox, misbehave, services)


def test_wall_clock_budget_bounds_a_run_blocked_in_the_host(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    budget = dataclasses.replace(sandbox.config, wall_budget_s=0.3)
    outcome = sandbox.run(misbehave, services, ["wait"], config=budget)
    assert outcome.status is RunStatus.TIMED_OUT
    assert "budget" in (outcome.error or "")
    assert outcome.output == "waiting"


def test_unbounded_allocation_hits_the_memory_cap(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    capped = dataclasses.replace(sandbox.config, memory_limit_bytes=48 * MIB)
    outcome = sandbox.run(misbehave, services, ["alloc"], config=capped)
    assert outcome.status in (RunStatus.GUEST_ERROR, RunStatus.TRAPPED)
    assert "MemoryError" in (outcome.error or "") or "memory" in (outcome.error or "").lower()
    _assert_host_still_serves(sandbox, misbehave, services)


def test_deep_recursion_traps(sandbox: Sandbox, misbehave: Component, services: TableServices) -> None:
    outcome = sandbox.run(misbehave, services, ["recurse"])
    assert outcome.status is RunStatus.TRAPPED
    assert "stack" in (outcome.error or "") or "unreachable" in (outcome.error or "")
    assert "wasm backtrace" not in (outcome.error or "")  # the headline, not the backtrace
    _assert_host_still_serves(sandbox, misbehave, services)


def test_files_are_not_visible(
    sandbox: Sandbox, misbehave: Component, services: TableServices, tmp_path: object
) -> None:
    outcome = sandbox.run(misbehave, services, ["read_file", str(tmp_path)])
    assert outcome.status is RunStatus.OK, outcome.error
    results = json.loads(outcome.output)
    assert len(results) == 4
    assert all(r.startswith("denied:") for r in results), results


def test_environment_is_empty(
    sandbox: Sandbox, misbehave: Component, services: TableServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WAFER_TEST_CANARY", "secret")
    assert os.environ["WAFER_TEST_CANARY"] == "secret"
    outcome = sandbox.run(misbehave, services, ["env"])
    assert outcome.status is RunStatus.OK, outcome.error
    assert json.loads(outcome.output) == {}


def test_sockets_cannot_be_opened(sandbox: Sandbox, misbehave: Component, services: TableServices) -> None:
    outcome = sandbox.run(misbehave, services, ["open_socket"])
    assert outcome.status is RunStatus.OK, outcome.error
    results = json.loads(outcome.output)
    assert results
    assert all(r.startswith("denied:") for r in results), results


def test_guest_exception_ends_the_run_with_its_traceback(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    outcome = sandbox.run(misbehave, services, ["fail"])
    assert outcome.status is RunStatus.GUEST_ERROR
    error = outcome.error or ""
    assert "Traceback" in error
    assert "inner_helper" in error
    assert "ValueError: boom from the guest" in error
    _assert_host_still_serves(sandbox, misbehave, services)


def test_guest_stdout_and_stderr_go_to_the_log_tagged_with_the_run(
    sandbox: Sandbox, misbehave: Component, services: TableServices, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="wafer.guest")
    handle = sandbox.start(misbehave, services, ["print_out"])
    outcome = handle.wait(timeout_s=120)
    assert outcome.status is RunStatus.OK, outcome.error
    assert outcome.output == "table-model"  # print() does not reach the client's output
    messages = [r.getMessage() for r in caplog.records if r.name == "wafer.guest"]
    assert f"[run {handle.run_id} stdout] hello on stdout" in messages
    assert f"[run {handle.run_id} stderr] hello on stderr" in messages
