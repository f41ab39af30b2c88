"""Uploaded inferlet components on disk, named by the SHA-256 of their bytes (so an upload is
idempotent and a run names exactly the code it runs)."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from wasmtime.component import Component

from host.daemon.errors import InvalidRequest, NotFound
from host.sandbox import ComponentLoadError, Sandbox

_ID = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class StoredInferlet:
    id: str
    size_bytes: int
    created_at: float

    def describe(self) -> dict[str, object]:
        return {"id": self.id, "object": "inferlet", "bytes": self.size_bytes, "created": int(self.created_at)}


class InferletStore:
    def __init__(self, directory: Path, sandbox: Sandbox) -> None:
        self._dir = directory
        self._sandbox = sandbox
        self._lock = threading.Lock()
        self._dir.mkdir(parents=True, exist_ok=True)

    def _path(self, inferlet_id: str) -> Path:
        return self._dir / f"{inferlet_id.removeprefix('sha256:')}.wasm"

    def add(self, data: bytes) -> tuple[StoredInferlet, bool]:
        """Store and compile a component (blocking: the first compile takes seconds). Returns the
        entry and whether it was new. Bytes that are not a component are refused with a 400."""
        if not data:
            raise InvalidRequest("the upload is empty: send the component's bytes as the body", param="body")
        inferlet_id = f"sha256:{hashlib.sha256(data).hexdigest()}"
        path = self._path(inferlet_id)
        with self._lock:
            is_new = not path.exists()
            if is_new:
                tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
                tmp.write_bytes(data)
                try:
                    self._sandbox.load(tmp)
                except ComponentLoadError as exc:
                    tmp.unlink(missing_ok=True)
                    # The message names the file: the client sees "the upload", never a server path.
                    reason = str(exc).replace(str(tmp), "the upload")
                    raise InvalidRequest(f"not a loadable WebAssembly component: {reason}", param="body") from None
                os.replace(tmp, path)
        return self._entry(inferlet_id, path), is_new

    def load(self, inferlet_id: str) -> Component:
        path = self._existing(inferlet_id)
        try:
            return self._sandbox.load(path)
        except ComponentLoadError as exc:
            reason = str(exc).replace(str(path), "the stored component")
            raise InvalidRequest(f"inferlet {inferlet_id} cannot be loaded: {reason}", param="inferlet") from None

    def get(self, inferlet_id: str) -> StoredInferlet:
        return self._entry(inferlet_id, self._existing(inferlet_id))

    def list(self) -> list[StoredInferlet]:
        entries = []
        for path in sorted(self._dir.glob("*.wasm")):
            entries.append(self._entry(f"sha256:{path.stem}", path))
        return entries

    def _existing(self, inferlet_id: str) -> Path:
        if not _ID.match(inferlet_id):
            raise InvalidRequest(
                f"inferlet ids look like 'sha256:<64 hex digits>', got {inferlet_id!r}", param="inferlet"
            )
        path = self._path(inferlet_id)
        if not path.exists():
            raise NotFound(f"no inferlet {inferlet_id}; upload it first", param="inferlet", code="inferlet_not_found")
        return path

    @staticmethod
    def _entry(inferlet_id: str, path: Path) -> StoredInferlet:
        st = path.stat()
        return StoredInferlet(inferlet_id, st.st_size, st.st_mtime if st.st_mtime else time.time())
