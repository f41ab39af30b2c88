"""Loading progress on stderr: one line rewritten in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Progress:
    def __init__(self, what: str, total: int, enabled: bool = True) -> None:
        self.what = what
        self.total = max(total, 1)
        self.enabled = enabled
        self.start = time.monotonic()
        self.is_tty = sys.stderr.isatty()
        self.last_pct = -1

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        pct = 100 * done // self.total
        if pct == self.last_pct or (not self.is_tty and pct % 25 and done != self.total):
            return
        self.last_pct = pct
        end = "\r" if self.is_tty and done < self.total else "\n"
        elapsed = time.monotonic() - self.start
        print(
            f"[wafer torch] {self.what}: {done}/{self.total} ({pct}%) {elapsed:.1f}s",
            end=end,
            file=sys.stderr,
            flush=True,
        )


@contextmanager
def ticking(what: str, every_s: float = 10.0, enabled: bool = True) -> Iterator[None]:
    """Around a long step with no steps to count (a compiler run): its elapsed time on stderr
    every `every_s` seconds, so the terminal never sits silent, then the total."""
    if not enabled:
        yield
        return
    start, done = time.monotonic(), threading.Event()
    is_tty = sys.stderr.isatty()

    def tick() -> None:
        while not done.wait(every_s):
            elapsed = time.monotonic() - start
            end = "\r" if is_tty else "\n"
            print(f"[wafer torch] {what}: {elapsed:.0f}s so far", end=end, file=sys.stderr, flush=True)

    thread = threading.Thread(target=tick, name="wafer-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        print(f"[wafer torch] {what}: done in {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)
