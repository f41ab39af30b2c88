"""`host.daemon.run_log`: long text is cut to its bound saying how much was cut; a run log counts
the bytes it keeps (dropped events included); a run's log lines are bounded; messages a run never
received are let go at its end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from host.daemon import run_log as run_log_module
from host.daemon.run_log import EVENT_OVERHEAD_BYTES, MAX_ERROR_BYTES, RunLog, bounded_text


def test_bounded_text_keeps_short_text_and_cuts_long_text_saying_how_much() -> None:
    assert bounded_text("x" * MAX_ERROR_BYTES) == "x" * MAX_ERROR_BYTES
    assert bounded_text("x" * 100, 10) == f"{'x' * 10}... (90 bytes more)"
    # Cut by UTF-8 bytes, never inside a character: "é" is two bytes.
    assert bounded_text("é" * 10, 5) == "éé... (16 bytes more)"


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _log(loop: asyncio.AbstractEventLoop) -> RunLog:
    return RunLog("a test run", loop, max_inbound_bytes=1024)


def test_the_log_counts_what_it_keeps(loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_log_module, "MAX_KEPT_EVENTS", 2)
    log = _log(loop)
    log.emit("abc")
    log.send("é")
    assert log.num_bytes == 2 * EVENT_OVERHEAD_BYTES + 3 + 2
    log.emit("x" * 100)  # the first event is dropped: its bytes are no longer counted
    assert log.num_bytes == 2 * EVENT_OVERHEAD_BYTES + 2 + 100
    log.end({"state": "failed", "error": "boom"})
    assert log.num_bytes == 2 * EVENT_OVERHEAD_BYTES + 100 + 4


def test_a_run_s_log_lines_are_bounded(loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wafer.run")
    _log(loop).log(7, "info", "y" * 100_000)
    (record,) = caplog.records
    assert record.getMessage().startswith("[run 7] yyy")
    assert record.getMessage().endswith(f"... ({100_000 - MAX_ERROR_BYTES} bytes more)")


def test_messages_a_run_never_received_are_let_go_at_its_end(loop: asyncio.AbstractEventLoop) -> None:
    log = _log(loop)
    log.push("one")
    log.end({"state": "succeeded"})
    with pytest.raises(TimeoutError):
        log.receive(0.01)
