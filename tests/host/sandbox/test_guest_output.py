"""Guest stdout and stderr: read from pipes by threads of ours, never through a Python callback
that wasmtime's own threads would call (one that came while the interpreter exited aborted the
process, SIGABRT, "panic in a function that cannot unwind"); a trap's report still carries the
guest's stderr, and `wafer run` exits 1, never 134, after a guest panics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import wasmtime
from wasmtime.component import Component

from host.sandbox import RunStatus, Sandbox
from tests.host.sandbox.table_services import TableServices

MISBEHAVE = Path(__file__).parent / "inferlets" / "misbehave"


def test_no_python_callback_receives_guest_output(
    sandbox: Sandbox, misbehave: Component, services: TableServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(self: wasmtime.WasiConfig, callback: object) -> None:
        raise AssertionError("guest output must not go through a callback from wasmtime's threads")

    monkeypatch.setattr(wasmtime.WasiConfig, "stdout_custom", property(fset=refused))
    monkeypatch.setattr(wasmtime.WasiConfig, "stderr_custom", property(fset=refused))
    outcome = sandbox.run(misbehave, services, ["print_out"])
    assert outcome.status is RunStatus.OK, outcome.error
    assert "hello on stderr" in outcome.stderr


def test_a_guest_panic_is_a_trap_that_shows_the_guests_stderr(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    outcome = sandbox.run(misbehave, services, ["panic"])
    assert outcome.status is RunStatus.TRAPPED
    assert outcome.error is not None and "--- guest stderr ---" in outcome.error
    assert "surrogates not allowed" in outcome.error


def test_wafer_run_exits_1_after_a_guest_panic_every_time(misbehave: Component) -> None:
    # Before the pipes, 2 of 16 such runs aborted with 134 on a loaded 2-core machine.
    codes = []
    for _ in range(8):
        done = subprocess.run(
            [sys.executable, "-m", "host.cli", "run", str(MISBEHAVE), "--", "panic"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        codes.append(done.returncode)
        assert "cannot unwind" not in done.stderr
    assert codes == [1] * 8
