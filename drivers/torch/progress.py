"""Loading progress on stderr: one line rewritten in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time


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
