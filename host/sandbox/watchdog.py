"""Stopping a guest that computes without calling the host: every store gets an epoch-deadline
callback, and a deadline a fraction of a second ahead. When guest code reaches the deadline
(wasmtime checks at function entries and loop heads), the callback runs on the run's own thread
and decides: a cancel, the wall clock or the inactivity window ends the run with that reason;
otherwise the guest goes on to the next deadline. So a cancel or the wall clock stops even a
guest spinning in a loop within `WATCHDOG_CHECK_S`, and the watchdog (no host call for the inactivity
window) is measured from the last host call, not armed per call.

wasmtime-py does not wrap the C API's `wasmtime_store_epoch_deadline_callback`; its ctypes
binding is used directly. One callback serves every store: it finds its run through the
thread-local of `run_state`, so nothing per store must be kept alive beside the store.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import wasmtime
from wasmtime import _bindings as ffi

from host.sandbox.run_state import current_or_none

_log = logging.getLogger("wafer.sandbox")

_CONTINUE = 0  # WASMTIME_UPDATE_DEADLINE_CONTINUE

_CALLBACK_TYPE = ffi._wasmtime_store_epoch_deadline_callback.argtypes[1]
_FINALIZER_TYPE = ffi._wasmtime_store_epoch_deadline_callback.argtypes[3]


def _error(message: str) -> int:
    """A new wasmtime error for the callback to return (wasmtime takes ownership: it traps)."""
    err = ffi.wasmtime_error_new(message.encode("utf-8", errors="replace"))
    return int(ctypes.cast(err, ctypes.c_void_p).value or 0)


def _on_deadline(_context: Any, _env: Any, delta: Any, kind: Any) -> int:
    try:
        run = current_or_none()
        if run is None:  # guest code outside a run's thread: nothing to decide for; stop it
            return _error("guest code ran outside a run")
        reason = run.check_while_computing()
        if reason is not None:
            return _error(reason)
        try:
            run.yield_guest()  # another run of its group waits: take turns
        except wasmtime.WasmtimeError as exc:  # stopped while waiting for its turn
            return _error(str(exc))
        delta[0] = run.config.ticks(run.next_check_s())
        kind[0] = _CONTINUE
        return 0
    except BaseException as exc:  # an exception must not cross into wasmtime
        _log.exception("the epoch-deadline callback failed")
        return _error(f"sandbox failure in the watchdog: {type(exc).__name__}: {exc}")


_CALLBACK = _CALLBACK_TYPE(_on_deadline)
_FINALIZER = _FINALIZER_TYPE(lambda _env: None)


def install(store: wasmtime.Store) -> None:
    """Give `store` the callback; `RunState.rearm_watchdog` sets its first deadline."""
    ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), _CALLBACK, None, _FINALIZER)
