"""One run: its thread, its Store, and the bookkeeping when it ends however it ends."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import wasmtime
from wasmtime.component import Component, Linker

from host.errors import HostError
from host.sandbox import watchdog
from host.sandbox.config import MIB, SandboxConfig
from host.sandbox.guest_output import GuestStream
from host.sandbox.outcome import RunOutcome, RunStatus
from host.sandbox.resources import ResourceKind
from host.sandbox.run_state import RunState, bind_current

_log = logging.getLogger("wafer.sandbox")

EXPORT_NAME = "run"
# How long a run's end waits for the guest's output pipes to be read to their end.
_OUTPUT_DRAIN_S = 2.0


class Run:
    """Runs `component` on its own thread; `outcome` is set exactly once, when the thread ends."""

    def __init__(self, state: RunState, engine: wasmtime.Engine, linker: Linker, component: Component) -> None:
        self.state = state
        self._engine = engine
        self._linker = linker
        self._component = component
        self._done = threading.Event()
        self._outcome: RunOutcome | None = None
        logged = state.config.host_limits.stdio_log_bytes
        self._stdout = GuestStream(state.run_id, "stdout", keep=False, max_logged_bytes=logged)
        self._stderr = GuestStream(state.run_id, "stderr", keep=True, max_logged_bytes=logged)
        self._thread = threading.Thread(target=self._main, name=f"wafer-run-{state.run_id}", daemon=True)
        self._store_ref: weakref.ref[wasmtime.Store] | None = None
        self.held_contexts = self.held_pages = 0  # set as the run ends (RunOutcome)

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> RunOutcome | None:
        self._done.wait(timeout_s)
        return self._outcome

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    def _main(self) -> None:
        bind_current(self.state)
        status, error = RunStatus.OK, None
        share, group = self.state.compute, self.state.group
        if share is not None and group:
            share.join(group)
        try:
            status, error = self._execute()
        except Exception as exc:  # the run thread must always report an outcome
            _log.exception("[run %d] sandbox failure", self.state.run_id)
            status, error = RunStatus.TRAPPED, f"sandbox failure: {type(exc).__name__}: {exc}"
        finally:
            self.state.leave_guest()
            if share is not None and group:
                share.quit(group)
            num_leaked = self._free_resources()
            self.state.store = None  # the last reference: WASI closes the guest's output pipes
            self._collect_store()
            for stream in (self._stdout, self._stderr):
                stream.wait_closed(_OUTPUT_DRAIN_S)
            if status is RunStatus.TRAPPED and (stderr := self._stderr.text.strip()):
                error = f"{error}\n--- guest stderr ---\n{stderr}"
            bind_current(None)
            output = getattr(self.state.io, "output", "")
            self._outcome = RunOutcome(
                run_id=self.state.run_id,
                status=status,
                output=output if isinstance(output, str) else "",
                error=error,
                stderr=self._stderr.text,
                num_leaked_resources=num_leaked,
                held_contexts=self.held_contexts,
                held_pages=self.held_pages,
            )
            self._done.set()

    def _collect_store(self) -> None:
        """Free the Store now if a reference cycle still holds it. An error raised in a host
        function (a cancel, a limit) is caught by wasmtime-py in a frame that holds it, and
        those frames hold the call's frames back to the Store: only a gc frees them."""
        if self._store_ref is not None and self._store_ref() is not None:
            gc.collect(1)
            if self._store_ref() is not None:
                gc.collect()

    def _new_store(self) -> wasmtime.Store:
        store = wasmtime.Store(self._engine)
        config = self.state.config
        store.set_limits(
            memory_size=config.linear_memory_bytes,
            memories=config.max_memories,
            tables=config.max_tables,
            table_elements=config.max_table_elements,
            instances=config.max_instances,
        )
        wasi = wasmtime.WasiConfig()  # no preopens, no env, no args; sockets are denied
        wasi.stdout_file = self._stdout.open_pipe()  # pipes, not callbacks: see guest_output.py
        wasi.stderr_file = self._stderr.open_pipe()
        store.set_wasi(wasi)
        watchdog.install(store)
        self._stdout.release_writer()
        self._stderr.release_writer()
        return store

    def _execute(self) -> tuple[RunStatus, str | None]:
        state = self.state
        if state.cancel_requested.is_set():
            return RunStatus.CANCELLED, "cancelled before it started"
        store = self._new_store()
        self._store_ref = weakref.ref(store)
        state.store = store
        state.rearm_watchdog()
        try:
            state.enter_guest()  # start functions are guest code
            try:
                instance = self._linker.instantiate(store, self._component)
            except wasmtime.WasmtimeError as exc:
                exc.__traceback__ = None
                if "limit" in str(exc):
                    return RunStatus.LIMIT_EXCEEDED, _instance_limit_message(str(exc), state.config)
                raise
            run_fn = instance.get_func(store, EXPORT_NAME)
            if run_fn is None:
                return RunStatus.TRAPPED, f"the component exports no `{EXPORT_NAME}` function"
            result = run_fn(store)
            run_fn.post_return(store)
        except wasmtime.WasmtimeError as exc:
            # wasmtime-py raises its error from a local, so the error and its frames form a cycle
            # that holds the Store (and the guest's output pipes) until a gc: cut it now.
            exc.__traceback__ = None
            return self._classify_failure(exc)
        if isinstance(result, str):
            if state.cancel_requested.is_set():
                # Most likely the error of a host call the cancel failed (a pass, a receive):
                # the run ended because it was cancelled, not because the inferlet is wrong.
                return RunStatus.CANCELLED, f"cancelled (the inferlet then returned: {result})"
            return RunStatus.GUEST_ERROR, result
        return RunStatus.OK, None

    def _classify_failure(self, exc: wasmtime.WasmtimeError) -> tuple[RunStatus, str]:
        state = self.state
        message = str(exc)
        if state.stop_reason == "cancelled" or state.cancel_requested.is_set():
            return RunStatus.CANCELLED, "cancelled"
        if state.stop_reason is not None:
            return state.stop_status, state.stop_reason
        if "interrupt" in message:  # the watchdog's callback records why; this is a fallback
            return RunStatus.TIMED_OUT, "interrupted by the epoch deadline"
        _log.info("[run %d] trapped: %s", state.run_id, message)
        return RunStatus.TRAPPED, _trap_headline(message)  # the guest's stderr is added at the end

    def _free_resources(self) -> int:
        """Release what the guest still holds; the engine's `end_run` then frees the rest."""
        state = self.state
        try:
            self.held_contexts, self.held_pages = state.services.run_usage(state.run_id)
        except HostError:
            pass
        leaked = state.resources.drain()
        for slot in leaked:
            if slot.kind is ResourceKind.CONTEXT:
                assert isinstance(slot.value, int)
                try:
                    state.services.release_context(state.run_id, slot.value)
                except HostError as exc:  # already gone (a cancel ended the run): keep freeing
                    _log.debug("[run %d] freeing leaked context: %s", state.run_id, exc)
        try:
            state.services.end_run(state.run_id)
        except HostError as exc:
            _log.warning("[run %d] end_run failed: %s", state.run_id, exc)
        if leaked:
            _log.info("[run %d] freed %d resources the guest left behind", state.run_id, len(leaked))
        return len(leaked)


def _instance_limit_message(cause: str, config: SandboxConfig) -> str:
    """What a run may have, for a component that asks for more at instantiation."""
    return (
        f"the component needs more than a run may have ({_trap_headline(cause)}): a run gets "
        f"{config.max_memories} linear memory of up to {config.linear_memory_bytes // MIB} MiB "
        f"(run_memory_mib), {config.max_tables} tables of up to {config.max_table_elements} slots "
        f"and {config.max_instances} core instances"
    )


def _trap_headline(message: str) -> str:
    """wasmtime's trap text is a long wasm backtrace followed by "Caused by:" and the cause;
    the cause is what a user needs (the full text goes to the log)."""
    _, sep, cause = message.rpartition("Caused by:")
    lines = [line.strip() for line in (cause if sep else message).splitlines() if line.strip()]
    return "; ".join(lines[:3]) if lines else "wasm trap"
