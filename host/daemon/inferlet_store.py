"""Uploaded inferlet components on disk, named by the SHA-256 of their bytes (so an upload is
idempotent and a run names exactly the code it runs), each visible only to the API keys that
uploaded it unless an upload shared it (`<hash>.acl.json` beside it; a component stored before
there were such files is shared). Another key asking for it is told it does not exist."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from host.daemon.errors import BadRequest, NotFound
from host.sandbox import ComponentLoadError, LoadedInferlet, Sandbox

_ID = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class StoredInferlet:
    id: str
    size_bytes: int
    created_at: float
    is_shared: bool = False

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "inferlet",
            "bytes": self.size_bytes,
            "created": int(self.created_at),
            "shared": self.is_shared,
        }


@dataclass(frozen=True, slots=True)
class _Access:
    owners: frozenset[str]
    is_shared: bool

    def allows(self, owner: str) -> bool:
        return self.is_shared or owner in self.owners


class InferletStore:
    def __init__(self, directory: Path, sandbox: Sandbox) -> None:
        self._dir = directory
        self._sandbox = sandbox
        self._lock = threading.Lock()
        self._dir.mkdir(parents=True, exist_ok=True)

    def _path(self, inferlet_id: str) -> Path:
        return self._dir / f"{inferlet_id.removeprefix('sha256:')}.wasm"

    def _acl_path(self, inferlet_id: str) -> Path:
        return self._dir / f"{inferlet_id.removeprefix('sha256:')}.acl.json"

    def _access(self, inferlet_id: str) -> _Access:
        try:
            data = json.loads(self._acl_path(inferlet_id).read_text())
        except FileNotFoundError:
            return _Access(frozenset(), True)  # stored before access lists: shared
        return _Access(frozenset(data.get("owners", [])), bool(data.get("shared", False)))

    def _grant(self, inferlet_id: str, owner: str, shared: bool, is_new: bool) -> _Access:
        """Add `owner` (and `shared`, once set it stays) to the access list; lock held."""
        path = self._acl_path(inferlet_id)
        before = _Access(frozenset(), False) if is_new else self._access(inferlet_id)
        after = _Access(before.owners | {owner}, before.is_shared or shared)
        if after != before or not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps({"owners": sorted(after.owners), "shared": after.is_shared}))
            os.replace(tmp, path)
        return after

    def add(self, data: bytes, owner: str = "", shared: bool = False) -> tuple[StoredInferlet, bool]:
        """Store and compile a component (blocking: the first compile takes seconds) for `owner`
        (an API key's id; `shared`: for every key). Returns the entry and whether it was new to
        this owner. Bytes that are not a component are refused with a 400."""
        if not data:
            raise BadRequest("the upload is empty: send the component's bytes as the body", param="body")
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
                    raise BadRequest(f"not a loadable WebAssembly component: {reason}", param="body") from None
                os.replace(tmp, path)
            was_visible = not is_new and self._access(inferlet_id).allows(owner)
            self._grant(inferlet_id, owner, shared, is_new)
        return self._entry(inferlet_id, path), not was_visible

    def load(self, inferlet_id: str, owner: str = "") -> LoadedInferlet:
        path = self._existing(inferlet_id, owner)
        try:
            return self._sandbox.load(path)
        except ComponentLoadError as exc:
            reason = str(exc).replace(str(path), "the stored component")
            raise BadRequest(f"inferlet {inferlet_id} cannot be loaded: {reason}", param="inferlet") from None

    def get(self, inferlet_id: str, owner: str = "") -> StoredInferlet:
        return self._entry(inferlet_id, self._existing(inferlet_id, owner))

    def list(self, owner: str = "") -> list[StoredInferlet]:
        """The inferlets `owner` may run: its own and the shared ones."""
        entries = []
        for path in sorted(self._dir.glob("*.wasm")):
            inferlet_id = f"sha256:{path.stem}"
            if self._access(inferlet_id).allows(owner):
                entries.append(self._entry(inferlet_id, path))
        return entries

    def _existing(self, inferlet_id: str, owner: str) -> Path:
        if not _ID.match(inferlet_id):
            raise BadRequest(f"inferlet ids look like 'sha256:<64 hex digits>', got {inferlet_id!r}", param="inferlet")
        path = self._path(inferlet_id)
        if not path.exists() or not self._access(inferlet_id).allows(owner):  # another key's: not found
            raise NotFound(f"no inferlet {inferlet_id}; upload it first", param="inferlet", code="inferlet_not_found")
        return path

    def _entry(self, inferlet_id: str, path: Path) -> StoredInferlet:
        st = path.stat()
        shared = self._access(inferlet_id).is_shared
        return StoredInferlet(inferlet_id, st.st_size, st.st_mtime if st.st_mtime else time.time(), shared)
