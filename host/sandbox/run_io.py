"""The run's conversation with its client: streamed output, messages both ways, log lines."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

_log = logging.getLogger("wafer.run")

_CLOSED = object()


class RunIO(Protocol):
    """What `runtime` host functions call. Implementations must be thread-safe."""

    def emit(self, chunk: str) -> None: ...

    def send(self, message: str) -> None: ...

    def receive(self, timeout_s: float) -> str | None:
        """The next client message; None if the client closed its side. Raises TimeoutError."""
        ...

    def log(self, run_id: int, level: str, message: str) -> None: ...


class BufferedRunIO:
    """Collects output and sent messages; `on_chunk` sees each output chunk as it arrives."""

    def __init__(self, on_chunk: Callable[[str], None] | None = None) -> None:
        self._on_chunk = on_chunk
        self._lock = threading.Lock()
        self._chunks: list[str] = []
        self.sent: list[str] = []
        self._inbox: queue.Queue[object] = queue.Queue()

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

    def push(self, message: str) -> None:
        """Deliver a client message to the run."""
        self._inbox.put(message)

    def close(self) -> None:
        """The client will send nothing more."""
        self._inbox.put(_CLOSED)

    def receive(self, timeout_s: float) -> str | None:
        try:
            item = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError("no message from the client") from None
        if item is _CLOSED:
            self._inbox.put(_CLOSED)  # later receives see the close too
            return None
        assert isinstance(item, str)
        return item

    def log(self, run_id: int, level: str, message: str) -> None:
        _log.log(logging.getLevelName(level.upper()), "[run %d] %s", run_id, message)
