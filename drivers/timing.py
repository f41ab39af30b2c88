"""Precise waits: `time.sleep` overshoots by ~0.1-0.2 ms on Linux (more in a VM), and event-loop
timers round to milliseconds; a simulated device needs better than both.

`sleep_until` blocks a thread. `DueTimer.wait_until` waits on the event loop itself: a Linux
timerfd (nanosecond deadline, on the clock `time.perf_counter` reads) wakes the loop shortly
before the deadline and the loop spins the rest, so a reply due at T leaves at T, not at T plus
a thread's wake-up and a hop back to the loop. Elsewhere (no timerfd, or not asyncio) it falls
back to `sleep_until` in a worker thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import sys
import time

import anyio.to_thread

log = logging.getLogger(__name__)

# Wake this long before a deadline, then spin: covers the wake-up latency of a sleeping thread.
_SPIN_S = 0.00025
_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1


def sleep_until(deadline: float) -> None:
    """Return at `deadline` (`time.perf_counter` seconds), give or take a few microseconds."""
    remaining = deadline - time.perf_counter()
    if remaining > _SPIN_S:
        time.sleep(remaining - _SPIN_S)
    spin_until(deadline)


def spin_until(deadline: float) -> None:
    while time.perf_counter() < deadline:
        pass


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    """libc with timerfd, when `time.perf_counter` reads CLOCK_MONOTONIC (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another async library (trio)
        return False
    return True


class DueTimer:
    """Waits for deadlines on the running event loop (one waiter at a time); `close` it."""

    def __init__(self) -> None:
        self._fd = -1
        if _LIBC is not None:
            self._fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
            if self._fd < 0:
                log.warning("timerfd_create failed (errno %d): replies wait in a thread", ctypes.get_errno())

    @property
    def uses_timerfd(self) -> bool:
        return self._fd >= 0

    async def wait_until(self, deadline: float) -> None:
        """Return at `deadline` (`time.perf_counter` seconds), give or take a few microseconds."""
        if deadline <= time.perf_counter():
            return
        if self._fd < 0 or not _on_asyncio():
            await anyio.to_thread.run_sync(sleep_until, deadline)
            return
        wake_at = deadline - _SPIN_S
        if wake_at > time.perf_counter():
            await self._wait_fd(wake_at)
        spin_until(deadline)

    async def _wait_fd(self, wake_at: float) -> None:
        assert _LIBC is not None
        seconds = int(wake_at)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(seconds, int((wake_at - seconds) * 1e9)))
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            await anyio.to_thread.run_sync(sleep_until, wake_at)
            return
        loop = asyncio.get_running_loop()
        fired: asyncio.Future[None] = loop.create_future()

        def on_readable() -> None:
            try:
                os.read(self._fd, 8)  # the expiry count; reading it re-arms readiness
            except BlockingIOError:
                return  # not expired yet (a spurious wake-up)
            if not fired.done():
                fired.set_result(None)

        loop.add_reader(self._fd, on_readable)
        try:
            await fired
        finally:
            loop.remove_reader(self._fd)
            if not fired.done():  # cancelled: disarm, so a late expiry is not left to read
                _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(_Itimerspec()), None)
                try:
                    os.read(self._fd, 8)
                except BlockingIOError:
                    pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
