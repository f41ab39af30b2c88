"""Guest stdout/stderr, cut into lines and logged with the run id; stderr is also kept so that a
trap's report can show the guest's own traceback."""

from __future__ import annotations

import logging

_log = logging.getLogger("wafer.guest")

# Enough for a Python traceback; a guest printing without bound must not grow host memory.
MAX_KEPT_BYTES = 64 * 1024


class GuestStream:
    def __init__(self, run_id: int, name: str, *, keep: bool) -> None:
        self._run_id = run_id
        self._name = name
        self._keep = keep
        self._partial = b""
        self._kept = bytearray()

    def write(self, data: bytes) -> None:
        if self._keep:
            self._kept += data
            if len(self._kept) > MAX_KEPT_BYTES:
                del self._kept[: len(self._kept) - MAX_KEPT_BYTES]
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._log_line(line)
        if len(self._partial) > MAX_KEPT_BYTES:
            self._log_line(self._partial)
            self._partial = b""

    def flush(self) -> None:
        if self._partial:
            self._log_line(self._partial)
            self._partial = b""

    @property
    def text(self) -> str:
        return self._kept.decode("utf-8", errors="replace")

    def _log_line(self, line: bytes) -> None:
        _log.info("[run %d %s] %s", self._run_id, self._name, line.decode("utf-8", errors="replace"))
