"""The supervised driver's output (its loading progress, its warnings) reaches the daemon's log
line by line while it starts, and a driver that fails to start is quoted in the error."""

from __future__ import annotations

import logging
import time

import pytest

from host.daemon.config import DaemonConfig
from host.daemon.errors import DriverUnavailable
from host.daemon.supervisor import Supervisor


def test_driver_output_reaches_the_daemon_log(caplog: pytest.LogCaptureFixture) -> None:
    supervisor = Supervisor(DaemonConfig(driver="dummy", driver_args=("--log-level", "INFO")))
    with caplog.at_level(logging.INFO, logger="wafer.daemon.driver"):
        supervisor.start()
        try:
            supervisor.engine(timeout_s=30)
            pid = supervisor.status().pid
            deadline = time.monotonic() + 5
            while "listening on" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            supervisor.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "wafer.daemon.driver"]
    assert any(line.startswith(f"driver {pid}: ") and "listening on unix:" in line for line in lines), lines


def test_a_driver_that_cannot_start_is_quoted(caplog: pytest.LogCaptureFixture) -> None:
    config = DaemonConfig(driver="dummy", driver_args=("--no-such-option",), restart_backoff_initial_s=60.0)
    supervisor = Supervisor(config)
    with caplog.at_level(logging.INFO, logger="wafer.daemon.driver"):
        supervisor.start()
        try:
            deadline = time.monotonic() + 30
            while not supervisor.status().last_error and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(DriverUnavailable, match="no-such-option"):
                supervisor.engine(timeout_s=0)
        finally:
            supervisor.stop()
    assert "unrecognized arguments: --no-such-option" in supervisor.status().last_error
    assert any("unrecognized arguments" in r.getMessage() for r in caplog.records)
