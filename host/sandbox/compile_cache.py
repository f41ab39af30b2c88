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
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import wasmtime
from wasmtime.component import Component

from host.sandbox.compile_worker import CompileFailed, compile_in_child
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
    """`max_loaded_bytes` bounds the components kept loaded in memory (each counted at the size
    of its compiled file, which it maps): past it the least recently used ones are dropped (a
    run that holds one keeps it alive; the next load maps the cached file again). A compile runs
    outside the cache's lock, so loads of other components never wait for it; two loads of the
    same file compile it once. With `compile_memory_bytes` (> 0) a compile runs in a child
    process whose writable memory is capped there (`compile_worker`): the host's memory never
    grows with a compile, and one that needs more fails with a ComponentLoadError saying so."""

    def __init__(
        self,
        engine: wasmtime.Engine,
        directory: Path,
        max_loaded_bytes: int = 1 << 30,
        compile_memory_bytes: int = 0,
    ) -> None:
        self._engine = engine
        self._compile_memory_bytes = compile_memory_bytes
        self._dir = directory
        self._max_loaded_bytes = max_loaded_bytes
        self._lock = threading.Lock()
        self._loaded: OrderedDict[tuple[str, int, int], tuple[Component, int]] = OrderedDict()
        self._loaded_bytes = 0
        self._loading: dict[tuple[str, int, int], threading.Lock] = {}

    @property
    def num_loaded(self) -> int:
        with self._lock:
            return len(self._loaded)

    def load(self, wasm_path: Path, progress: Callable[[str], None] | None = None) -> Component:
        """The component in `wasm_path`, compiling it only if no compiled copy is cached
        (`progress` is told when a compile starts and ends)."""
        try:
            st = wasm_path.stat()
        except OSError as exc:
            raise ComponentLoadError(f"cannot read component {wasm_path}: {exc}") from exc
        identity = (str(wasm_path.resolve()), st.st_mtime_ns, st.st_size)
        with self._lock:
            hit = self._hit(identity)
            if hit is not None:
                return hit
            file_lock = self._loading.setdefault(identity, threading.Lock())
        with file_lock:  # one compile per file; other files go on meanwhile
            with self._lock:
                hit = self._hit(identity)
                if hit is not None:
                    return hit
            try:
                component, size = self._load_uncached(wasm_path, progress)
            finally:
                with self._lock:
                    self._loading.pop(identity, None)
            with self._lock:
                self._loaded[identity] = (component, size)
                self._loaded_bytes += size
                while self._loaded_bytes > self._max_loaded_bytes and len(self._loaded) > 1:
                    _, (_, dropped) = self._loaded.popitem(last=False)
                    self._loaded_bytes -= dropped
            return component

    def _hit(self, identity: tuple[str, int, int]) -> Component | None:
        entry = self._loaded.get(identity)
        if entry is None:
            return None
        self._loaded.move_to_end(identity)
        return entry[0]

    def compiled_path(self, wasm_path: Path) -> Path:
        return self._dir / f"{cache_key(file_digest(wasm_path))}.cwasm"

    def _load_uncached(self, wasm_path: Path, progress: Callable[[str], None] | None) -> tuple[Component, int]:
        compiled = self.compiled_path(wasm_path)
        if compiled.exists():
            try:
                return Component.deserialize_file(self._engine, str(compiled)), compiled.stat().st_size
            except wasmtime.WasmtimeError as exc:
                _log.warning("discarding unreadable compiled component %s: %s", compiled, exc)
        self._dir.mkdir(parents=True, exist_ok=True)
        say = progress or (lambda _message: None)
        size_mib = wasm_path.stat().st_size / 2**20
        say(f"compiling {wasm_path.name} ({size_mib:.0f} MiB) for this machine: once per build, seconds to a minute")
        start = time.monotonic()
        loaded = self._compile(wasm_path, compiled)
        say(f"compiled in {time.monotonic() - start:.1f} s (kept in {self._dir})")
        return loaded

    def _compile(self, wasm_path: Path, compiled: Path) -> tuple[Component, int]:
        if self._compile_memory_bytes > 0:
            try:
                compile_in_child(wasm_path, compiled, self._compile_memory_bytes)
            except CompileFailed as exc:
                if exc.is_memory:
                    raise ComponentLoadError(f"{exc} (component_compile_mib)") from None
                raise ComponentLoadError(f"{wasm_path} is not a valid component: {exc}") from None
            return Component.deserialize_file(self._engine, str(compiled)), compiled.stat().st_size
        try:
            component = Component.from_file(self._engine, str(wasm_path))
        except wasmtime.WasmtimeError as exc:
            raise ComponentLoadError(f"{wasm_path} is not a valid component: {exc}") from exc
        data = component.serialize()
        tmp = compiled.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, compiled)  # atomic: concurrent writers leave one whole file
        return component, len(data)
