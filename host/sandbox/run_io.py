"""The run's conversation with its client: streamed output, messages both ways, log lines."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from host.sandbox.config import MIB
from host.sandbox.errors import InboxFull

_log = logging.getLogger("wafer.run")

_CLOSED = object()


def utf8_len(text: str) -> int:
    """`text`'s length in UTF-8 bytes (without encoding it when it is ASCII, the common case)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class RunIO(Protocol):
    """What `runtime` host functions call. Implementations must be thread-safe."""

    def emit(self, chunk: str) -> None: ...

    def send(self, message: str) -> None: ...

    def receive(self, timeout_s: float) -> str | None:
        """The next client message; None if the client closed its side. Raises TimeoutError."""
        ...

    def log(self, run_id: int, level: str, message: str) -> None: ...


class Inbox:
    """Client messages waiting for the run: `push` and `close` from the client's side, a blocking
    `receive` on the run's thread. Waiting messages hold at most `max_bytes` (UTF-8): a run that
    never receives cannot make the host keep what its clients send without bound."""

    def __init__(self, max_bytes: int = 16 * MIB) -> None:
        self._queue: queue.Queue[object] = queue.Queue()
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._pending_bytes = 0

    def push(self, message: str) -> None:
        """Queue `message`; InboxFull (nothing queued) past the limit."""
        size = utf8_len(message)
        with self._lock:
            if self._pending_bytes + size > self._max_bytes:
                raise InboxFull(
                    f"the run has {self._pending_bytes} bytes of messages it has not received; this one "
                    f"({size} bytes) would pass the limit of {self._max_bytes} bytes"
                )
            self._pending_bytes += size
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(_CLOSED)

    def receive(self, timeout_s: float) -> str | None:
        """The next message; None once the client closed its side. Raises TimeoutError."""
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError("no message from the client") from None
        if item is _CLOSED:
            self._queue.put(_CLOSED)  # later receives see the close too
            return None
        assert isinstance(item, str)
        with self._lock:
            self._pending_bytes -= utf8_len(item)
        return item


class BufferedRunIO:
    """Collects output and sent messages; `on_chunk` sees each output chunk as it arrives and
    `on_send` each sent message."""

    def __init__(
        self,
        on_chunk: Callable[[str], None] | None = None,
        max_inbound_bytes: int = 16 * MIB,
        on_send: Callable[[str], None] | None = None,
    ) -> None:
        self._on_chunk = on_chunk
        self._on_send = on_send
        self._lock = threading.Lock()
        self._chunks: list[str] = []
        self.sent: list[str] = []
        self._inbox = Inbox(max_inbound_bytes)

    @property
    def output(self) -> str:
        with self._lock:
            return "".join(self._chunks)

    def emit(self, chunk: str) -> None:
        with self._lock:
            self._chunks.append(chunk)
        if self._on_chunk is not None:
            self._on_chunk(chunk)

    def send(self, message: str) -> None:
        with self._lock:
            self.sent.append(message)
        if self._on_send is not None:
            self._on_send(message)

    def push(self, message: str) -> None:
        """Deliver a client message to the run."""
        self._inbox.push(message)

    def close(self) -> None:
        """The client will send nothing more."""
        self._inbox.close()

    def receive(self, timeout_s: float) -> str | None:
        return self._inbox.receive(timeout_s)

    def log(self, run_id: int, level: str, message: str) -> None:
        _log.log(logging.getLevelName(level.upper()), "[run %d] %s", run_id, message)
