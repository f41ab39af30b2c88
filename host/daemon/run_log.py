"""What one run has said so far (output chunks, messages, its end), kept so HTTP clients can
follow it live or replay it, and counted in bytes (what the daemon keeps of a finished run);
filled by the run's thread, read on the event loop. Also the bound on a run's error text.

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
from host.sandbox.run_io import Inbox, utf8_len

log = logging.getLogger("wafer.run")

# A run that streams without bound must not grow daemon memory without bound: past this, the
# oldest events are dropped (a follower that falls that far behind is told so).
MAX_KEPT_EVENTS = 100_000
# What the host holds for one event besides its text (the event, the string's header, the
# list's slot), measured with tracemalloc on CPython 3.11: 147 bytes for a one-character chunk.
EVENT_OVERHEAD_BYTES = 150
# A run's error text, and each line a run logs, are kept and logged up to this many UTF-8 bytes
# (a Python traceback fits); the rest is cut off, and the text says how much.
MAX_ERROR_BYTES = 16 * 1024


def bounded_text(text: str, max_bytes: int = MAX_ERROR_BYTES) -> str:
    """`text` up to `max_bytes` UTF-8 bytes, then "... (N bytes more)" when it was longer."""
    if len(text) <= max_bytes // 4:  # short enough whatever its characters (4 bytes at most each)
        return text
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return text
    head = data[:max_bytes].decode("utf-8", "ignore")  # a character cut in two is left out
    return f"{head}... ({len(data) - len(head.encode('utf-8', 'surrogatepass'))} bytes more)"


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
        self._num_bytes = 0  # what the kept events hold (`num_bytes`)
        self._max_inbound_bytes = max_inbound_bytes
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
        log.log(logging.getLevelName(level.upper()), "[run %d] %s", run_id, bounded_text(message))

    # ------------------------------------------------------------------ the daemon's side

    def push(self, message: str) -> None:
        self._inbox.push(message)

    def close_inbox(self) -> None:
        self._inbox.close()

    def end(self, data: dict[str, Any]) -> None:
        """The run's last event. Messages it never received are dropped: nobody will."""
        self._inbox = Inbox(self._max_inbound_bytes)
        self._append("end", data)

    @property
    def is_ended(self) -> bool:
        with self._lock:
            return self._is_ended

    @property
    def num_bytes(self) -> int:
        """What the kept events hold: their text's UTF-8 bytes plus EVENT_OVERHEAD_BYTES each
        (an end event counts its error text)."""
        with self._lock:
            return self._num_bytes

    def snapshot(self) -> list[RunEvent]:
        """The events kept so far."""
        with self._lock:
            return list(self._events)

    def _append(self, kind: str, data: Any) -> None:
        with self._lock:
            if self._is_ended:
                return
            self._events.append(RunEvent(self._first_seq + len(self._events), kind, data))
            self._num_bytes += _size_of(kind, data)
            if kind == "end":
                self._is_ended = True
            if len(self._events) > MAX_KEPT_EVENTS:
                drop = len(self._events) - MAX_KEPT_EVENTS
                self._num_bytes -= sum(_size_of(e.kind, e.data) for e in self._events[:drop])
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


def end_event_bytes(data: dict[str, Any]) -> int:
    """What an end event holds, as `RunLog.num_bytes` counts it: its error text."""
    error = data.get("error")
    return EVENT_OVERHEAD_BYTES + (utf8_len(error) if isinstance(error, str) else 0)


def _size_of(kind: str, data: Any) -> int:
    return end_event_bytes(data) if kind == "end" else EVENT_OVERHEAD_BYTES + utf8_len(data)
