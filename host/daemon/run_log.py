"""What one run has said so far (output chunks, messages, its end), kept so HTTP clients can
follow it live or replay it; filled by the run's thread, read on the event loop.

It implements the sandbox's `RunIO`; it knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from host.sandbox.config import MIB
from host.sandbox.run_io import Inbox

log = logging.getLogger("wafer.run")

# A run that streams without bound must not grow daemon memory without bound: past this, the
# oldest events are dropped (a follower that falls that far behind is told so).
MAX_KEPT_EVENTS = 100_000


@dataclass(frozen=True, slots=True)
class RunEvent:
    seq: int
    kind: str  # "output" | "message" | "end"
    data: Any


class RunLog:
    """Thread-safe event log and inbox of one run. `follow` is called on `loop`."""

    def __init__(self, run_label: str, loop: asyncio.AbstractEventLoop, max_inbound_bytes: int = 16 * MIB) -> None:
        self._label = run_label
        self._loop = loop
        self._lock = threading.Lock()
        self._events: list[RunEvent] = []
        self._first_seq = 0
        self._is_ended = False
        self._changed = asyncio.Event()
        self._is_notify_queued = False  # a `_notify` is on its way to the loop: no need for another
        self._inbox = Inbox(max_inbound_bytes)

    # ------------------------------------------------------------------ RunIO (run thread)

    def emit(self, chunk: str) -> None:
        self._append("output", chunk)

    def send(self, message: str) -> None:
        self._append("message", message)

    def receive(self, timeout_s: float) -> str | None:
        return self._inbox.receive(timeout_s)

    def log(self, run_id: int, level: str, message: str) -> None:
        log.log(logging.getLevelName(level.upper()), "[run %d] %s", run_id, message)

    # ------------------------------------------------------------------ the daemon's side

    def push(self, message: str) -> None:
        self._inbox.push(message)

    def close_inbox(self) -> None:
        self._inbox.close()

    def end(self, data: dict[str, Any]) -> None:
        self._append("end", data)

    @property
    def is_ended(self) -> bool:
        with self._lock:
            return self._is_ended

    def snapshot(self) -> list[RunEvent]:
        """The events kept so far."""
        with self._lock:
            return list(self._events)

    def _append(self, kind: str, data: Any) -> None:
        with self._lock:
            if self._is_ended:
                return
            self._events.append(RunEvent(self._first_seq + len(self._events), kind, data))
            if kind == "end":
                self._is_ended = True
            if len(self._events) > MAX_KEPT_EVENTS:
                drop = len(self._events) - MAX_KEPT_EVENTS
                del self._events[:drop]
                self._first_seq += drop
            if self._is_notify_queued:  # followers will see this event with the ones before it
                return
            self._is_notify_queued = True
        try:
            self._loop.call_soon_threadsafe(self._notify)
        except RuntimeError:
            pass  # the event loop is gone (daemon shutting down): nobody is following

    def _notify(self) -> None:
        """On the loop: wake every follower (each holds the event that was current)."""
        with self._lock:
            self._is_notify_queued = False  # events appended from now on queue a new one
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, start_seq: int = 0) -> AsyncIterator[RunEvent]:
        """Events from `start_seq` on, live, until the run's end event."""
        async for batch in self.follow_batches(start_seq):
            for event in batch:
                yield event

    async def follow_batches(self, start_seq: int = 0) -> AsyncIterator[list[RunEvent]]:
        """`follow`, in the batches that were there together each time the follower looked (a
        follower that falls behind gets several events at once, and may send them as one)."""
        seq = start_seq
        while True:
            with self._lock:
                if seq < self._first_seq:
                    raise LookupError(f"events before {self._first_seq} of {self._label} were dropped")
                new = self._events[seq - self._first_seq :]
                waiter = self._changed
            if new:
                yield new
                if new[-1].kind == "end":  # always the last event: nothing follows it
                    return
            seq += len(new)
            await waiter.wait()
