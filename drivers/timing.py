"""Precise waits: `time.sleep` overshoots by ~0.15-0.2 ms on Linux, and event-loop timers
round to milliseconds; a simulated device needs better than both."""

from __future__ import annotations

import time

# Sleep to this long before a deadline, then spin.
_SPIN_S = 0.00025


def sleep_until(deadline: float) -> None:
    """Return at `deadline` (`time.perf_counter` seconds), give or take a few microseconds."""
    remaining = deadline - time.perf_counter()
    if remaining > _SPIN_S:
        time.sleep(remaining - _SPIN_S)
    while time.perf_counter() < deadline:
        pass
