"""Compiled components on disk, keyed by content hash (of the component without the sources an
inferlet on wafer's base carries) + wasmtime version + engine flags.

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
from dataclasses import dataclass
from pathlib import Path

import wasmtime
from wasmtime.component import Component

from host.app_bundle import AppSources, BundleError, split_sources
from host.sandbox.compile_worker import CompileFailed, compile_in_child
from host.sandbox.errors import ComponentLoadError
from host.sandbox.imports import check_imports
from host.sandbox.wasm_engine import ENGINE_FLAGS, WASMTIME_VERSION

_log = logging.getLogger("wafer.sandbox")


@dataclass(frozen=True, slots=True)
class LoadedInferlet:
    """What a run starts from: the compiled component, and the inferlet's sources when the
    component is wafer's base carrying them (`host.app_bundle`); None for a self-contained one."""

    component: Component
    app: AppSources | None


def cache_key(content_digest: str) -> str:
    meta = hashlib.sha256(f"{WASMTIME_VERSION}|{ENGINE_FLAGS}".encode()).hexdigest()[:16]
    return f"{content_digest[:32]}-{meta}"


def _read_component(wasm_path: Path) -> tuple[bytes, AppSources | None]:
    """The component to compile (without its sources) and the sources it carries."""
    try:
        data = wasm_path.read_bytes()
    except OSError as exc:
        raise ComponentLoadError(f"cannot read component {wasm_path}: {exc}") from exc
    try:
        return split_sources(data)
    except BundleError as exc:
        raise ComponentLoadError(f"{wasm_path} is not a valid inferlet: {exc}") from None


_MAX_KNOWN_FILES = 4096


class CompileCache:
    """Compiled components are keyed by the digest of the component without its sources, so every
    inferlet built on wafer's base shares one compiled copy (one compile, one mapping).
    `max_loaded_bytes` bounds the components kept loaded in memory (each counted at the size
    of its compiled file, which it maps): past it the least recently used ones are dropped (a
    run that holds one keeps it alive; the next load maps the cached file again). A compile runs
    outside the cache's lock, so loads of other components never wait for it; two loads of the
    same component compile it once. With `compile_memory_bytes` (> 0) a compile runs in a child
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
        self._loaded: OrderedDict[str, tuple[Component, int]] = OrderedDict()  # by compile key
        self._loaded_bytes = 0
        self._loading: dict[str, threading.Lock] = {}
        # File identity -> (compile key, sources): a file loaded before costs neither a read nor a hash.
        self._files: OrderedDict[tuple[str, int, int], tuple[str, AppSources | None]] = OrderedDict()

    @property
    def num_loaded(self) -> int:
        """Compiled components held in memory (inferlets on one base share one)."""
        with self._lock:
            return len(self._loaded)

    def load(self, wasm_path: Path, progress: Callable[[str], None] | None = None) -> LoadedInferlet:
        """The inferlet in `wasm_path`, compiling its component only if no compiled copy is
        cached (`progress` is told when a compile starts and ends)."""
        try:
            st = wasm_path.stat()
        except OSError as exc:
            raise ComponentLoadError(f"cannot read component {wasm_path}: {exc}") from exc
        identity = (str(wasm_path.resolve()), st.st_mtime_ns, st.st_size)
        with self._lock:
            known = self._files.get(identity)
            if known is not None:
                self._files.move_to_end(identity)
                hit = self._hit(known[0])
                if hit is not None:
                    return LoadedInferlet(hit, known[1])
        component_bytes, app = _read_component(wasm_path)
        key = cache_key(hashlib.sha256(component_bytes).hexdigest())
        with self._lock:
            self._files[identity] = (key, app)
            while len(self._files) > _MAX_KNOWN_FILES:
                self._files.popitem(last=False)
            hit = self._hit(key)
            if hit is not None:
                return LoadedInferlet(hit, app)
            key_lock = self._loading.setdefault(key, threading.Lock())
        with key_lock:  # one compile per component; other components go on meanwhile
            with self._lock:
                hit = self._hit(key)
                if hit is not None:
                    return LoadedInferlet(hit, app)
            try:
                component, size = self._load_uncached(key, wasm_path, component_bytes, progress)
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            with self._lock:
                self._loaded[key] = (component, size)
                self._loaded_bytes += size
                while self._loaded_bytes > self._max_loaded_bytes and len(self._loaded) > 1:
                    _, (_, dropped) = self._loaded.popitem(last=False)
                    self._loaded_bytes -= dropped
            return LoadedInferlet(component, app)

    def forget(self, content_digest: str, wasm_path: Path) -> None:
        """Drop the compiled copy of the component in `wasm_path` (its digest without sources:
        `content_digest`), a component no longer wanted (a deleted upload), so uploads and
        deletes cannot fill the disk: from memory (runs holding it keep it) and from disk, unless
        another file loaded lately has the same component (inferlets on wafer's base share one)."""
        key = cache_key(content_digest)
        gone = str(wasm_path.resolve())
        with self._lock:
            others = [i for i, (k, _) in self._files.items() if k == key and i[0] != gone]
            if any(Path(i[0]).exists() for i in others):
                return
            entry = self._loaded.pop(key, None)
            if entry is not None:
                self._loaded_bytes -= entry[1]
            for identity in [i for i, (k, _) in self._files.items() if k == key]:
                del self._files[identity]
            (self._dir / f"{key}.cwasm").unlink(missing_ok=True)

    def _hit(self, key: str) -> Component | None:
        entry = self._loaded.get(key)
        if entry is None:
            return None
        self._loaded.move_to_end(key)
        return entry[0]

    def compiled_path(self, wasm_path: Path) -> Path:
        """Where the compiled copy of the component in `wasm_path` is (or will be) kept."""
        component_bytes, _ = _read_component(wasm_path)
        return self._dir / f"{cache_key(hashlib.sha256(component_bytes).hexdigest())}.cwasm"

    def _load_uncached(
        self, key: str, wasm_path: Path, component_bytes: bytes, progress: Callable[[str], None] | None
    ) -> tuple[Component, int]:
        """The component compiled (or read from disk), once its imports are known to be wafer's:
        a component that could reach an unvetted import never runs, nor stays loaded."""
        component, size = self._compiled(key, wasm_path, component_bytes, progress)
        check_imports(component, self._engine, str(wasm_path.name))
        return component, size

    def _compiled(
        self, key: str, wasm_path: Path, component_bytes: bytes, progress: Callable[[str], None] | None
    ) -> tuple[Component, int]:
        compiled = self._dir / f"{key}.cwasm"
        if compiled.exists():
            try:
                return Component.deserialize_file(self._engine, str(compiled)), compiled.stat().st_size
            except wasmtime.WasmtimeError as exc:
                _log.warning("discarding unreadable compiled component %s: %s", compiled, exc)
        self._dir.mkdir(parents=True, exist_ok=True)
        say = progress or (lambda _message: None)
        size_mib = len(component_bytes) / 2**20
        say(
            f"compiling {wasm_path.name} ({size_mib:.0f} MiB) for this machine: once per component "
            "(inferlets on wafer's base share one), seconds to a minute"
        )
        start = time.monotonic()
        loaded = self._compile(wasm_path, component_bytes, compiled)
        say(f"compiled in {time.monotonic() - start:.1f} s (kept in {self._dir})")
        return loaded

    def _compile(self, wasm_path: Path, component_bytes: bytes, compiled: Path) -> tuple[Component, int]:
        if self._compile_memory_bytes > 0:
            try:
                compile_in_child(wasm_path, compiled, self._compile_memory_bytes)
            except CompileFailed as exc:
                if exc.is_memory:
                    raise ComponentLoadError(f"{exc} (component_compile_mib)") from None
                raise ComponentLoadError(f"{wasm_path} is not a valid component: {exc}") from None
            return Component.deserialize_file(self._engine, str(compiled)), compiled.stat().st_size
        try:
            component = Component(self._engine, component_bytes)
        except wasmtime.WasmtimeError as exc:
            raise ComponentLoadError(f"{wasm_path} is not a valid component: {exc}") from exc
        data = component.serialize()
        tmp = compiled.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, compiled)  # atomic: concurrent writers leave one whole file
        return component, len(data)
