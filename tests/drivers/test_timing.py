"""`drivers.timing`: the waits a simulated device replies by. A reply is never sent before its
due time; on Linux the wait runs on the event loop (a timerfd), with no worker thread."""

from __future__ import annotations

import sys
import time

import anyio
import anyio.to_thread
import pytest

from drivers import timing
from drivers.timing import DueTimer, sleep_until

pytestmark = pytest.mark.anyio
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux only")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_sleep_until_never_returns_early() -> None:
    for delay in (0.0, 0.0001, 0.002):
        deadline = time.perf_counter() + delay
        sleep_until(deadline)
        assert time.perf_counter() >= deadline


async def test_wait_until_never_returns_early() -> None:
    timer = DueTimer()
    try:
        for delay in (-0.001, 0.0, 0.0001, 0.0003, 0.002, 0.01):
            deadline = time.perf_counter() + delay
            await timer.wait_until(deadline)
            assert time.perf_counter() >= deadline
    finally:
        timer.close()


@linux_only
async def test_wait_until_runs_on_the_loop_without_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_threads(*args: object, **kwargs: object) -> None:
        raise AssertionError("waited in a worker thread")

    monkeypatch.setattr(anyio.to_thread, "run_sync", no_threads)
    timer = DueTimer()
    assert timer.uses_timerfd
    try:
        for _ in range(3):
            deadline = time.perf_counter() + 0.003
            await timer.wait_until(deadline)
            assert time.perf_counter() >= deadline
    finally:
        timer.close()


@linux_only
async def test_a_cancelled_wait_leaves_the_timer_usable() -> None:
    timer = DueTimer()
    try:
        with anyio.move_on_after(0.002):
            await timer.wait_until(time.perf_counter() + 10.0)
        # The cancelled deadline is disarmed: the next wait ends at its own deadline, not 10 s on.
        t0 = time.perf_counter()
        with anyio.fail_after(5):
            await timer.wait_until(t0 + 0.003)
        assert time.perf_counter() >= t0 + 0.003
    finally:
        timer.close()


async def test_without_timerfd_it_falls_back_to_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "_LIBC", None)
    timer = DueTimer()
    assert not timer.uses_timerfd
    deadline = time.perf_counter() + 0.002
    await timer.wait_until(deadline)
    assert time.perf_counter() >= deadline
    timer.close()


async def test_off_asyncio_it_waits_in_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under another async library (trio) there is no asyncio loop to add the timerfd to."""
    monkeypatch.setattr(timing, "_on_asyncio", lambda: False)
    waited_in_thread: list[bool] = []
    run_sync = anyio.to_thread.run_sync

    async def recording_run_sync(func: object, *args: object) -> object:
        waited_in_thread.append(True)
        return await run_sync(func, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(anyio.to_thread, "run_sync", recording_run_sync)
    timer = DueTimer()
    try:
        deadline = time.perf_counter() + 0.002
        await timer.wait_until(deadline)
        assert time.perf_counter() >= deadline and waited_in_thread
    finally:
        timer.close()
