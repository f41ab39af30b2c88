"""The one wrapper every host function goes through.

It finds the calling run, stops a cancelled or over-budget run, gives the run's compute slot
up for the call (host.sandbox.compute_share), re-arms the inactivity watchdog, and turns any
unexpected Python exception into `wasmtime.WasmtimeError` (the only exception type wasmtime-py
50 delivers to the right thread; others can surface in another run).
Expected failures are not exceptions: host functions return a WIT `result` error string.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import wasmtime
from wasmtime.component import Record, ResourceAny

from host.sandbox import raw_calls
from host.sandbox.resources import ResourceKind
from host.sandbox.run_state import RunState, current

P = ParamSpec("P")
R = TypeVar("R")

_log = logging.getLogger("wafer.sandbox")


def host_function(fn: Callable[Concatenate[RunState, P], R]) -> Callable[..., R]:
    """Adapt `fn(run, *args)` to wasmtime's `(store, *args)` calling convention."""

    @functools.wraps(fn)
    def call(store: wasmtime.StoreContext, *args: P.args, **kwargs: P.kwargs) -> R:
        started_s, cpu_s = time.perf_counter(), time.thread_time()
        run = current()
        run.check_can_continue()
        run.leave_guest()
        outer, run.call_context = run.call_context, store
        try:
            return fn(run, *args, **kwargs)
        except wasmtime.WasmtimeError:
            raise
        except Exception as exc:  # the boundary: only WasmtimeError may cross it
            _log.exception("[run %d] host function %s failed", run.run_id, fn.__name__)
            raise wasmtime.WasmtimeError(f"host error in {fn.__name__}: {type(exc).__name__}: {exc}") from None
        finally:
            run.call_context = outer
            run.pace(time.thread_time() - cpu_s)
            run.enter_guest()
            run.rearm_watchdog()
            run.note_host_call(started_s)

    return call


def record(**fields: Any) -> Record:
    """A WIT record value; Python names map to WIT's kebab-case field names."""
    rec = Record()
    for name, value in fields.items():
        setattr(rec, name.replace("_", "-"), value)
    return rec


def field(rec: Any, name: str) -> Any:
    """Field `name` (Python spelling) of a record that came from the guest."""
    return getattr(rec, name.replace("_", "-"))


def borrowed_rep(run: RunState, handle: ResourceAny) -> int:
    """The host rep behind a `borrow<T>` argument."""
    assert run.call_context is not None
    rep: int = handle.to_host(run.call_context).rep
    return rep


def error_text(exc: BaseException) -> str:
    """The message an inferlet sees for an expected failure."""
    text = str(exc)
    return text if text else type(exc).__name__


def handle_id(kind: ResourceKind) -> raw_calls.RawHandler:
    """A raw `[method]T.id` for resource kind `kind`: the borrowed handle's rep, the number the
    group calls (`execute-all`, `decode-all`) take; a trap for a handle that is not live."""
    noun = kind.name.lower().replace("_", " ")

    def call(context: Any, args: Any) -> Any:
        rep = raw_calls.borrow_rep(context, args[0])
        try:
            current().resources.get(kind, rep)
        except KeyError:
            raise wasmtime.WasmtimeError(f"no live {noun} with handle {rep}") from None
        return raw_calls.u32(rep)

    return call
