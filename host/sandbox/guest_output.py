"""Guest stdout/stderr, cut into lines and logged with the run id (each stream up to a bound); the
end of stderr is also kept so that a trap's report can show the guest's own traceback.

WASI writes a guest's output from wasmtime's own (tokio) threads. Through a Python callback
(`WasiConfig.stdout_custom`) such a write can come while the interpreter exits, and the thread
is then unwound through Rust frames: the process aborts ("panic in a function that cannot
unwind", SIGABRT). So the guest writes into a pipe, and a Python thread of ours reads it.
"""

from __future__ import annotations

import logging
import os
import threading

_log = logging.getLogger("wafer.guest")

# Enough for a Python traceback; a guest printing without bound must not grow host memory.
MAX_KEPT_BYTES = 64 * 1024


class GuestStream:
    def __init__(self, run_id: int, name: str, *, keep: bool, max_logged_bytes: int) -> None:
        """`max_logged_bytes`: what the stream may write to the host's log (a guest printing
        without bound must not fill it); past it its lines are dropped, one line says so, and the
        kept end of stderr still follows the guest to its last byte."""
        self._run_id = run_id
        self._max_logged_bytes = max_logged_bytes
        self._name = name
        self._keep = keep
        self._partial = b""
        self._kept = bytearray()
        self._num_logged = 0  # bytes of lines logged
        self._is_cut = False  # lines were dropped past max_logged_bytes
        self._write_fd = -1
        self._reader: threading.Thread | None = None

    def open_pipe(self) -> str:
        """A path for WASI to open as this stream (the write end of a pipe this stream reads).
        Call `release_writer` once WASI has opened it."""
        read_fd, self._write_fd = os.pipe()
        self._reader = threading.Thread(
            target=self._drain, args=(read_fd,), name=f"wafer-run-{self._run_id}-{self._name}", daemon=True
        )
        self._reader.start()
        return f"/dev/fd/{self._write_fd}"

    def release_writer(self) -> None:
        """Close our copy of the write end: the pipe ends when WASI closes its own."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1

    def wait_closed(self, timeout_s: float) -> None:
        """Wait until the guest's side is closed (its Store dropped) and everything is read."""
        self.release_writer()
        if self._reader is not None:
            self._reader.join(timeout_s)

    def _drain(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 65536):
                self.write(data)
        finally:
            os.close(read_fd)
            self.flush()

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
        if self._num_logged + len(line) <= self._max_logged_bytes:
            self._num_logged += len(line)
            _log.info("[run %d %s] %s", self._run_id, self._name, line.decode("utf-8", errors="replace"))
        elif not self._is_cut:
            self._is_cut = True
            _log.warning(
                "[run %d %s] output limit for the host's log reached (%d bytes a stream); later lines are not logged",
                self._run_id,
                self._name,
                self._max_logged_bytes,
            )
