"""The sandbox facade: load components, start runs, cancel them, wait for their outcomes."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from host.errors import HostError
from host.sandbox import wasmtime_threads
from host.sandbox.compile_cache import CompileCache, LoadedInferlet
from host.sandbox.compute_share import ComputeShare
from host.sandbox.config import SandboxConfig
from host.sandbox.linker import new_linker
from host.sandbox.outcome import RunOutcome
from host.sandbox.run import Run
from host.sandbox.run_io import BufferedRunIO, RunIO
from host.sandbox.run_state import RunState
from host.sandbox.wasm_engine import EpochTicker, new_engine
from host.services import Services

_log = logging.getLogger("wafer.sandbox")

# Run ids scope ownership in the engine; unique per process even with several sandboxes.
_run_ids = itertools.count(1)
_run_ids_lock = threading.Lock()


def _next_run_id() -> int:
    with _run_ids_lock:
        return next(_run_ids)


class RunHandle:
    def __init__(self, run: Run) -> None:
        self._run = run

    @property
    def run_id(self) -> int:
        return self._run.state.run_id

    @property
    def io(self) -> RunIO:
        return self._run.state.io

    @property
    def is_done(self) -> bool:
        return self._run.is_done

    def cancel(self) -> None:
        """Stop the run at its next host call, or at its next check while it computes
        (`host.sandbox.watchdog`, every WATCHDOG_CHECK_S). Ending the run in the engine at once
        frees its pages and fails any pass it is waiting for, so a run blocked in a forward pass
        stops without waiting for the driver."""
        state = self._run.state
        if state.cancel_requested.is_set() or self._run.is_done:
            return
        state.cancel_requested.set()
        try:
            state.services.end_run(state.run_id)
        except HostError as exc:
            _log.warning("[run %d] ending the run in the engine on cancel failed: %s", state.run_id, exc)

    def stats(self) -> dict[str, float]:
        """Host calls, seconds in host functions and waiting for passes, start to first call."""
        return self._run.state.stats()

    def wait(self, timeout_s: float | None = None) -> RunOutcome:
        outcome = self._run.wait(timeout_s)
        if outcome is None:
            raise TimeoutError(f"run {self.run_id} still running after {timeout_s} s")
        return outcome


class Sandbox:
    """One Engine, one Linker and one compile cache, shared by every run."""

    def __init__(self, config: SandboxConfig) -> None:
        wasmtime_threads.install()
        self.config = config
        self._engine = new_engine()
        self._linker = new_linker(self._engine)
        self._cache = CompileCache(
            self._engine, config.compiled_dir, config.max_loaded_component_bytes, config.compile_memory_bytes
        )
        self._ticker = EpochTicker(self._engine, config)
        self._ticker.start()
        self.compute = ComputeShare(config.group_compute_slots) if config.group_compute_slots else None

    def close(self) -> None:
        self._ticker.stop()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def load(self, wasm_path: Path, progress: Callable[[str], None] | None = None) -> LoadedInferlet:
        """Compile (or fetch from the cache) the component at `wasm_path`; `progress` hears of a
        compile (it takes seconds: once per component and machine) when it starts and ends."""
        return self._cache.load(wasm_path, progress)

    def forget(self, content_digest: str, wasm_path: Path) -> None:
        """Drop the compiled copy of a component no longer wanted (`CompileCache.forget`)."""
        self._cache.forget(content_digest, wasm_path)

    def start(
        self,
        inferlet: LoadedInferlet,
        services: Services,
        args: Sequence[str] = (),
        io: RunIO | None = None,
        config: SandboxConfig | None = None,
        on_run_id: Callable[[int], None] | None = None,
        group: str = "",
    ) -> RunHandle:
        """Start a run on its own thread; `config` overrides this sandbox's limits for this run
        (the epoch tick is the sandbox's); `on_run_id` gets the run's id before it starts;
        `group`: who the run works for (an API key's id), whose shares it counts against."""
        state = RunState(
            run_id=_next_run_id(),
            args=list(args),
            services=services,
            io=io if io is not None else BufferedRunIO(),
            config=config if config is not None else self.config,
            started_at_s=time.monotonic(),
            app_files=inferlet.app.files if inferlet.app is not None else (),
            group=group,
            compute=self.compute,
        )
        run = Run(state, self._engine, self._linker, inferlet.component)
        if on_run_id is not None:
            on_run_id(state.run_id)
        run.start()
        return RunHandle(run)

    def run(
        self,
        inferlet: LoadedInferlet,
        services: Services,
        args: Sequence[str] = (),
        io: RunIO | None = None,
        config: SandboxConfig | None = None,
    ) -> RunOutcome:
        """Start a run and wait for its outcome."""
        return self.start(inferlet, services, args, io, config).wait()
