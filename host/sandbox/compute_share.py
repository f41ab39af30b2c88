"""Guest compute shared out by group (the daemon's API key): at most `slots` runs of one group
execute guest code at once, and runs of a group that wait take turns with those computing.

A run holds a slot while it is in guest code: from instantiation (a component's start functions
are guest code) to the end of its run, except while it is inside a host function (a forward pass,
a receive: waiting holds nothing). A run computing for long gives its slot up at each watchdog
check while another run of its group waits, and queues behind it. So one key's runs, however
many and however busy, take at most `slots` cores, and the other keys keep the rest.

Knows threads and groups, not runs: `may_continue` is how a waiting run learns it must stop.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable

# How often a waiting run checks whether it must stop (cancel, wall clock).
_WAIT_SLICE_S = 0.05


class ComputeShare:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        self._lock = threading.Lock()
        self._busy: Counter[str] = Counter()  # group -> runs holding a slot
        self._queues: dict[str, deque[threading.Event]] = {}  # group -> its waiting runs, first first
        self._live: Counter[str] = Counter()  # group -> its runs started and not ended

    def join(self, group: str) -> None:
        """A run of `group` starts (it counts as live until `quit`)."""
        with self._lock:
            self._live[group] += 1

    def quit(self, group: str) -> None:
        with self._lock:
            self._live[group] -= 1
            if not self._live[group]:
                del self._live[group]

    def num_other_groups(self, group: str) -> int:
        """Groups other than `group` with a run live (host work is paced by it)."""
        with self._lock:
            return len(self._live) - (1 if group in self._live else 0)

    def enter(self, group: str, may_continue: Callable[[], None]) -> None:
        """Take one of `group`'s slots, waiting in line for it. `may_continue` is called while
        waiting and may raise to stop waiting (the slot is then not held)."""
        with self._lock:
            queue = self._queues.setdefault(group, deque())
            if self._busy[group] < self.slots and not queue:
                self._busy[group] += 1
                return
            granted = threading.Event()
            queue.append(granted)
        try:
            while not granted.wait(_WAIT_SLICE_S):
                may_continue()
        except BaseException:
            with self._lock:
                if granted.is_set():  # granted as it gave up: pass the slot on
                    self._hand_on(group)
                else:
                    queue.remove(granted)
            raise

    def leave(self, group: str) -> None:
        """Give one of `group`'s slots back: to the first run waiting for one, if any."""
        with self._lock:
            self._hand_on(group)

    def has_waiters(self, group: str) -> bool:
        with self._lock:
            return bool(self._queues.get(group))

    def num_waiting(self, group: str) -> int:
        with self._lock:
            return len(self._queues.get(group, ()))

    def num_busy(self, group: str) -> int:
        with self._lock:
            return self._busy[group]

    def _hand_on(self, group: str) -> None:
        """A slot of `group` is free: the first in line gets it, or it is counted free; lock held."""
        queue = self._queues.get(group)
        if queue:
            queue.popleft().set()
            return
        assert self._busy[group] > 0, f"group {group!r} gave back a slot it did not hold"
        self._busy[group] -= 1
        if not self._busy[group]:
            del self._busy[group]
            self._queues.pop(group, None)
