"""Compiled components on disk, keyed by content hash + wasmtime version + engine flags.

A cached component loads with `Component.deserialize_file` (an mmap, ~2 ms) instead of a
multi-second compile. Loaded components are also kept in memory per file identity, so starting
a run of an already-loaded inferlet costs neither a hash nor a read.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import wasmtime
from wasmtime.component import Component

from host.sandbox.engine import ENGINE_FLAGS, WASMTIME_VERSION
from host.sandbox.errors import ComponentLoadError

_log = logging.getLogger("wafer.sandbox")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_key(content_digest: str) -> str:
    meta = hashlib.sha256(f"{WASMTIME_VERSION}|{ENGINE_FLAGS}".encode()).hexdigest()[:16]
    return f"{content_digest[:32]}-{meta}"


class CompileCache:
    def __init__(self, engine: wasmtime.Engine, directory: Path) -> None:
        self._engine = engine
        self._dir = directory
        self._lock = threading.Lock()
        self._loaded: dict[tuple[str, int, int], Component] = {}

    def load(self, wasm_path: Path) -> Component:
        """The component in `wasm_path`, compiling it only if no compiled copy is cached."""
        try:
            st = wasm_path.stat()
        except OSError as exc:
            raise ComponentLoadError(f"cannot read component {wasm_path}: {exc}") from exc
        identity = (str(wasm_path.resolve()), st.st_mtime_ns, st.st_size)
        with self._lock:
            component = self._loaded.get(identity)
            if component is None:
                component = self._load_uncached(wasm_path)
                self._loaded[identity] = component
            return component

    def compiled_path(self, wasm_path: Path) -> Path:
        return self._dir / f"{cache_key(file_digest(wasm_path))}.cwasm"

    def _load_uncached(self, wasm_path: Path) -> Component:
        compiled = self.compiled_path(wasm_path)
        if compiled.exists():
            try:
                return Component.deserialize_file(self._engine, str(compiled))
            except wasmtime.WasmtimeError as exc:
                _log.warning("discarding unreadable compiled component %s: %s", compiled, exc)
        try:
            component = Component.from_file(self._engine, str(wasm_path))
        except wasmtime.WasmtimeError as exc:
            raise ComponentLoadError(f"{wasm_path} is not a valid component: {exc}") from exc
        self._dir.mkdir(parents=True, exist_ok=True)
        tmp = compiled.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(component.serialize())
        os.replace(tmp, compiled)  # atomic: concurrent writers leave one whole file
        return component
