"""Uploaded inferlets on disk, named by the SHA-256 of the uploaded bytes (so an upload is
idempotent and a run names exactly the code it runs), each visible only to the API keys that
uploaded it unless one of them shared it, counted whole against each such key's quota, and
deleted when its last key deletes it. Another key asking for one is told it does not exist, and
nothing in an answer depends on whether another key uploaded the same bytes.

On disk, in `directory`: `<hex>.json` (the record: size, component, owners and when each
uploaded it, the keys that shared it), `components/<hex>.wasm` (the component without the
sources an inferlet on wafer's base carries, `host.app_bundle`: one file for every inferlet on
one base) and `<hex>.app.json` (those sources). The sources are read at a run's start and held
only while runs of the inferlet hold them (once, however many runs).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from host.app_bundle import AppSources, BundleError, decode_payload, encode_payload, split_sources
from host.daemon.errors import BadRequest, Forbidden, NotFound
from host.sandbox import ComponentLoadError, LoadedInferlet, Sandbox

log = logging.getLogger("wafer.daemon.store")

_ID = re.compile(r"^sha256:[0-9a-f]{64}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MODEL_PREFIX = "wafer/"  # an inferlet a key named as a model is `wafer/<name>` to that key


@dataclass(frozen=True, slots=True)
class UploadQuota:
    """What one API key may keep uploaded (`key_max_uploads`, `key_max_upload_bytes`)."""

    max_count: int
    max_bytes: int


UNLIMITED = UploadQuota(1 << 62, 1 << 62)


@dataclass(frozen=True, slots=True)
class StoredInferlet:
    id: str
    size_bytes: int
    created_at: float  # when the asking key uploaded it (a shared one: when it was shared)
    is_shared: bool = False
    model: str = ""  # the model id the asking key calls it by ("" = none)

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "inferlet",
            "bytes": self.size_bytes,
            "created": int(self.created_at),
            "shared": self.is_shared,
            "model": self.model or None,
        }


@dataclass(slots=True)
class _Record:
    size_bytes: int
    component: str  # hex digest naming components/<hex>.wasm
    has_app: bool  # sources in <hex>.app.json
    owners: dict[str, float] = field(default_factory=dict)  # key id -> when it uploaded
    sharers: set[str] = field(default_factory=set)  # owners that shared it: every key sees it
    models: dict[str, str] = field(default_factory=dict)  # owner -> the model name it gave it

    def allows(self, owner: str) -> bool:
        return owner in self.owners or bool(self.sharers)

    def as_seen_by(self, inferlet_id: str, owner: str) -> StoredInferlet:
        created = self.owners.get(owner)
        if created is None:
            created = min(self.owners[s] for s in self.sharers)
        name = self.models.get(owner)
        return StoredInferlet(
            inferlet_id, self.size_bytes, created, bool(self.sharers), MODEL_PREFIX + name if name else ""
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "bytes": self.size_bytes,
                "component": self.component,
                "app": self.has_app,
                "owners": self.owners,
                "sharers": sorted(self.sharers),
                "models": self.models,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> _Record:
        doc = json.loads(text)
        owners = {str(k): float(v) for k, v in doc["owners"].items()}
        component = str(doc["component"])
        if not _HEX.match(component):
            raise ValueError(f"bad component {component!r}")
        models = {str(k): str(v) for k, v in doc.get("models", {}).items() if k in owners and _MODEL_NAME.match(v)}
        sharers = {str(s) for s in doc["sharers"]} & set(owners)
        return cls(int(doc["bytes"]), component, bool(doc["app"]), owners, sharers, models)


class InferletStore:
    def __init__(self, directory: Path, sandbox: Sandbox) -> None:
        self._dir = directory
        self._components = directory / "components"
        self._sandbox = sandbox
        self._lock = threading.Lock()  # guards the records, the pins and every file write
        self._records: dict[str, _Record] = {}  # by hex digest
        self._pinned: Counter[str] = Counter()  # components an upload is checking: not deleted meanwhile
        # Sources in use by runs, by hex digest: held once however many runs hold them.
        self._in_use: weakref.WeakValueDictionary[str, AppSources] = weakref.WeakValueDictionary()
        self._components.mkdir(parents=True, exist_ok=True)
        self._read_records()

    # ------------------------------------------------------------------ paths and files

    def _record_path(self, hex_id: str) -> Path:
        return self._dir / f"{hex_id}.json"

    def _app_path(self, hex_id: str) -> Path:
        return self._dir / f"{hex_id}.app.json"

    def _component_path(self, component: str) -> Path:
        return self._components / f"{component}.wasm"

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: a reader (or a crash) sees the old file or the new, whole

    def _read_records(self) -> None:
        """The records on disk; files no record names (a crash between writes) are removed."""
        for path in self._dir.glob("*.wasm"):
            self._adopt(path)
        for path in self._dir.glob("*.json"):
            hex_id = path.name.removesuffix(".json")
            if not _HEX.match(hex_id):
                continue
            try:
                self._records[hex_id] = _Record.from_json(path.read_text())
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring the unreadable inferlet record %s: %s", path, exc)
        for path in self._dir.glob("*.app.json"):
            if path.name.removesuffix(".app.json") not in self._records:
                path.unlink(missing_ok=True)
        used = {r.component for r in self._records.values()}
        for path in self._components.glob("*.wasm"):
            if path.stem not in used:
                path.unlink(missing_ok=True)
        for path in [*self._dir.glob(".*.tmp*"), *self._components.glob(".*.tmp*")]:
            path.unlink(missing_ok=True)

    def _adopt(self, path: Path) -> None:
        """An upload stored whole, as the store kept them before records (`<hex>.wasm`, with its
        access list in `<hex>.acl.json`, or none: then it is every key's): into this layout."""
        hex_id, acl = path.stem, self._dir / f"{path.stem}.acl.json"
        if not _HEX.match(hex_id):
            return
        try:
            data = path.read_bytes()
            component_bytes, app = split_sources(data)
            access: dict[str, Any] = json.loads(acl.read_text()) if acl.exists() else {"owners": [""], "shared": True}
        except (OSError, ValueError) as exc:  # BundleError and JSON errors are ValueErrors
            log.warning("leaving %s as it is: cannot read it (%s)", path, exc)
            return
        component = hex_id if app is None else hashlib.sha256(component_bytes).hexdigest()
        created = path.stat().st_mtime
        owners = dict.fromkeys(map(str, access.get("owners", [])), created)
        record = _Record(len(data), component, app is not None, owners, set(owners) if access.get("shared") else set())
        self._write(self._component_path(component), component_bytes)
        if app is not None:
            self._write(self._app_path(hex_id), encode_payload(app))
        self._write(self._record_path(hex_id), record.to_json().encode())
        path.unlink()
        acl.unlink(missing_ok=True)

    # ------------------------------------------------------------------ uploads

    def add(
        self, data: bytes, owner: str = "", shared: bool = False, quota: UploadQuota = UNLIMITED, model: str = ""
    ) -> tuple[StoredInferlet, bool]:
        """Store and check a component (blocking: a first compile takes seconds) for `owner` (an
        API key's id; `shared`: for every key). Returns the entry and whether it was new to this
        owner. Bytes that are not a component are a 400; past the owner's quota, a 403.
        `model`: the owner calls it by `wafer/<model>` through the chat APIs (it speaks the chat
        protocol); the name moves from another of the owner's inferlets that had it."""
        if not data:
            raise BadRequest("the upload is empty: send the component's bytes as the body", param="body")
        if model and not _MODEL_NAME.match(model):
            raise BadRequest(
                f"model names are 1 to 64 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
                f"got {model!r}",
                param="model",
            )
        hex_id = hashlib.sha256(data).hexdigest()
        try:
            component_bytes, app = split_sources(data)
        except BundleError as exc:
            raise BadRequest(f"not a loadable WebAssembly component: {exc}", param="body") from None
        component = hex_id if app is None else hashlib.sha256(component_bytes).hexdigest()
        with self._lock:
            self._check_quota(hex_id, len(data), owner, quota)  # before a compile, as well as after
            self._pinned[component] += 1
        try:
            path = self._component_path(component)
            if not path.exists():
                self._write(path, component_bytes)  # the same bytes whoever writes them
            # Checked at every upload, not only the first: an answer must not depend on whether
            # another key uploaded these bytes.
            self._check_loads(path)
            with self._lock:
                self._check_quota(hex_id, len(data), owner, quota)
                record = self._records.get(hex_id)
                if record is None:
                    if app is not None:
                        self._write(self._app_path(hex_id), encode_payload(app))
                    record = _Record(len(data), component, app is not None)
                is_new = owner not in record.owners
                renamed = bool(model) and record.models.get(owner) != model
                if is_new or (shared and owner not in record.sharers) or renamed:
                    record.owners.setdefault(owner, time.time())
                    if shared:
                        record.sharers.add(owner)
                    if renamed:
                        self._take_name(owner, model)
                        record.models[owner] = model
                    self._write(self._record_path(hex_id), record.to_json().encode())
                    self._records[hex_id] = record
                return record.as_seen_by(f"sha256:{hex_id}", owner), is_new
        finally:
            with self._lock:
                self._pinned[component] -= 1
                if not self._pinned[component]:
                    del self._pinned[component]
                self._drop_component_if_unused(component)

    def _take_name(self, owner: str, model: str) -> None:
        """Lock held: `owner`'s inferlet called `model`, if any, is called so no more."""
        for hex_id, record in self._records.items():
            if record.models.get(owner) == model:
                del record.models[owner]
                self._write(self._record_path(hex_id), record.to_json().encode())

    def model(self, name: str, owner: str) -> str:
        """The id of the inferlet `owner` calls `wafer/<name>`; NotFound if none."""
        with self._lock:
            for hex_id, record in self._records.items():
                if record.models.get(owner) == name:
                    return f"sha256:{hex_id}"
        raise NotFound(
            f"The model '{MODEL_PREFIX}{name}' does not exist: upload an inferlet that speaks chat with "
            f"POST /v1/inferlets?model={name}",
            param="model",
            code="model_not_found",
        )

    def models(self, owner: str) -> list[StoredInferlet]:
        """The inferlets `owner` named as models, by name."""
        with self._lock:
            found = [r.as_seen_by(f"sha256:{h}", owner) for h, r in self._records.items() if owner in r.models]
        return sorted(found, key=lambda entry: entry.model)

    def _check_quota(self, hex_id: str, size_bytes: int, owner: str, quota: UploadQuota) -> None:
        """Lock held. Bytes this key has already are free; anything else counts whole, whoever
        else has it."""
        record = self._records.get(hex_id)
        if record is not None and owner in record.owners:
            return
        mine = [r.size_bytes for r in self._records.values() if owner in r.owners]
        if len(mine) + 1 > quota.max_count:
            raise Forbidden(
                f"this API key has {len(mine)} inferlets uploaded, the most it may keep (key_max_uploads); "
                "delete one (DELETE /v1/inferlets/{id}) before uploading another",
                code="upload_quota_exceeded",
            )
        if sum(mine) + size_bytes > quota.max_bytes:
            raise Forbidden(
                f"this upload ({size_bytes} bytes) would take this API key's uploads to {sum(mine) + size_bytes} "
                f"bytes, past its limit of {quota.max_bytes} (key_max_upload_bytes); delete some "
                "(DELETE /v1/inferlets/{id}) first",
                code="upload_quota_exceeded",
            )

    def _check_loads(self, path: Path) -> None:
        try:
            self._sandbox.load(path)
        except ComponentLoadError as exc:
            # The message names the file: the client sees "the upload", never a server path.
            reason = str(exc).replace(str(path), "the upload")
            raise BadRequest(f"not a loadable WebAssembly component: {reason}", param="body") from None

    def _drop_component_if_unused(self, component: str) -> None:
        """Lock held: delete a component file no record names and no upload is checking."""
        if component in self._pinned or any(r.component == component for r in self._records.values()):
            return
        path = self._component_path(component)
        self._sandbox.forget(component, path)  # its compiled copy (its digest is the compile key's)
        path.unlink(missing_ok=True)

    def delete(self, inferlet_id: str, owner: str) -> None:
        """Take `owner`'s upload back; the files go with the last owner. Another key's upload is
        a 404 (a shared one, which this key sees, a 403)."""
        hex_id = self._hex(inferlet_id)
        with self._lock:
            record = self._records.get(hex_id)
            if record is None or owner not in record.owners:
                if record is not None and record.allows(owner):
                    raise Forbidden(
                        f"inferlet {inferlet_id} is shared by another API key: only a key that uploaded it "
                        "may delete it",
                        param="inferlet",
                        code="inferlet_not_owned",
                    )
                raise self._not_found(inferlet_id)
            del record.owners[owner]
            record.sharers.discard(owner)
            record.models.pop(owner, None)
            if record.owners:
                self._write(self._record_path(hex_id), record.to_json().encode())
                return
            del self._records[hex_id]
            self._record_path(hex_id).unlink(missing_ok=True)  # first: no record names a missing file
            self._app_path(hex_id).unlink(missing_ok=True)
            self._drop_component_if_unused(record.component)

    # ------------------------------------------------------------------ reading

    def load(self, inferlet_id: str, owner: str = "") -> LoadedInferlet:
        """The inferlet, for a run: the compiled component, and the sources read from disk (or
        the copy that running runs of it hold)."""
        hex_id, record = self._visible(inferlet_id, owner)
        try:
            component = self._sandbox.load(self._component_path(record.component)).component
            return LoadedInferlet(component, self._sources(hex_id) if record.has_app else None)
        except (ComponentLoadError, BundleError, OSError) as exc:
            with self._lock:
                if hex_id not in self._records:  # deleted meanwhile
                    raise self._not_found(inferlet_id) from None
            reason = str(exc).replace(str(self._dir), "the store")
            raise BadRequest(f"inferlet {inferlet_id} cannot be loaded: {reason}", param="inferlet") from None

    def _sources(self, hex_id: str) -> AppSources:
        with self._lock:
            app = self._in_use.get(hex_id)
        if app is None:  # read outside the lock: a large one takes a while
            app = decode_payload(self._app_path(hex_id).read_bytes())
            with self._lock:
                app = self._in_use.setdefault(hex_id, app)
        return app

    def get(self, inferlet_id: str, owner: str = "") -> StoredInferlet:
        hex_id, record = self._visible(inferlet_id, owner)
        return record.as_seen_by(f"sha256:{hex_id}", owner)

    def list(self, owner: str = "", after: str = "", limit: int | None = None) -> list[StoredInferlet]:
        """The inferlets `owner` may run (its own and the shared ones), by id, past `after`."""
        after_hex = self._hex(after, "after") if after else ""
        with self._lock:
            found = [(hex_id, r) for hex_id, r in self._records.items() if hex_id > after_hex and r.allows(owner)]
            found.sort(key=lambda item: item[0])
            found = found if limit is None else found[:limit]
            return [r.as_seen_by(f"sha256:{hex_id}", owner) for hex_id, r in found]

    def usage(self, owner: str) -> tuple[int, int]:
        """(inferlets, bytes) counted against `owner`'s quota."""
        with self._lock:
            mine = [r.size_bytes for r in self._records.values() if owner in r.owners]
        return len(mine), sum(mine)

    def _visible(self, inferlet_id: str, owner: str) -> tuple[str, _Record]:
        hex_id = self._hex(inferlet_id)
        with self._lock:
            record = self._records.get(hex_id)
            if record is None or not record.allows(owner):  # another key's: not found
                raise self._not_found(inferlet_id)
            return hex_id, record

    @staticmethod
    def _hex(inferlet_id: str, param: str = "inferlet") -> str:
        if not _ID.match(inferlet_id):
            raise BadRequest(f"inferlet ids look like 'sha256:<64 hex digits>', got {inferlet_id!r}", param=param)
        return inferlet_id.removeprefix("sha256:")

    @staticmethod
    def _not_found(inferlet_id: str) -> NotFound:
        return NotFound(f"no inferlet {inferlet_id}; upload it first", param="inferlet", code="inferlet_not_found")
