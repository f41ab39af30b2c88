"""What one run may write to the host's log: through `runtime.log`, and on its stdout and stderr
(a loop of `log` wrote 1 GiB in 2.9 s). Driven by a real inferlet on the dummy driver."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from host.sandbox.config import RunHostLimits
from host.sandbox.guest_output import MAX_KEPT_BYTES, GuestStream
from host.testing import InferletRunner

LOG_HOG = Path(__file__).parent / "inferlets" / "log_hog"


def _lines(caplog: pytest.LogCaptureFixture, logger: str, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and needle in r.getMessage()]


@pytest.mark.dummy(host_limits=RunHostLimits(log_bytes=10_000))
def test_runtime_log_is_bounded_per_run(inferlet_runner: InferletRunner, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wafer.run")
    result = inferlet_runner.run(LOG_HOG, "log", "100", "1000")
    assert result.ok and result.output == "done", result.error  # logging too much does not end a run
    assert len(_lines(caplog, "wafer.run", "x" * 1000)) == 10
    [marker] = _lines(caplog, "wafer.run", "log limit reached")
    assert "the run logged 10000 bytes, and a run may log 10000; its later lines are dropped" in marker
    # The bound is per run: the next run logs again.
    caplog.clear()
    assert inferlet_runner.run(LOG_HOG, "log", "3", "1000").ok
    assert len(_lines(caplog, "wafer.run", "x" * 1000)) == 3


@pytest.mark.dummy(host_limits=RunHostLimits(stdio_log_bytes=10_000))
def test_guest_stdout_and_stderr_in_the_log_are_bounded(
    inferlet_runner: InferletRunner, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="wafer.guest")
    result = inferlet_runner.run(LOG_HOG, "print", "100", "1000")
    assert result.ok and result.output == "done", result.error
    for stream in ("stdout", "stderr"):
        assert len(_lines(caplog, "wafer.guest", f"{stream}] {'x' * 1000}")) == 10
        assert len(_lines(caplog, "wafer.guest", f"{stream}] output limit for the host's log reached")) == 1


def test_kept_stderr_is_its_last_bytes_whatever_was_logged() -> None:
    stream = GuestStream(1, "stderr", keep=True, max_logged_bytes=100)
    for i in range(100_000):
        stream.write(f"line {i}\n".encode())
    stream.flush()
    assert len(stream.text.encode()) <= MAX_KEPT_BYTES
    assert stream.text.endswith("line 99999\n")
