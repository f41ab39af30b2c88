"""Waiting for a future in slices, so that a waiter that must stop (a cancelled run, one out of
time) is asked between slices and can: a thread blocked in `future.result()` cannot be
interrupted otherwise."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
SLICE_S = 0.1  # how often a waiter is asked whether it may go on waiting


def result_in_slices(
    future: concurrent.futures.Future[T], may_wait: Callable[[], None] | None, timeout_s: float | None = None
) -> T:
    """`future.result()`, calling `may_wait` between slices (what it raises ends the wait);
    concurrent.futures.TimeoutError past `timeout_s` (None: no limit)."""
    if may_wait is None and timeout_s is None:
        return future.result()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
        if left <= 0:
            raise concurrent.futures.TimeoutError
        try:
            return future.result(timeout=left)
        except concurrent.futures.TimeoutError:
            if may_wait is not None:
                may_wait()
