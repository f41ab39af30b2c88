"""A raw ctypes path for the hottest host function, bypassing wasmtime-py's generic glue.

Measured with the stock path: a one-token decode step spent most of its host time in
wasmtime-py rebuilding the function's type objects and lifting the sampler record on every call
(about 300 us a token on a 2-core machine; the guest and the engine call were a small part).
Here the callback reads its arguments straight from the C values, with the layout fixed by the
WIT signature it is registered for. The arguments stay owned by the caller, which drops them
after the callback returns (wasmtime-py's glue nulls every pointer it takes for that reason):
the handler only reads them, and must copy what it keeps.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from ctypes import POINTER, byref
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime.component import LinkerInstance

_log = logging.getLogger("wafer.sandbox")

Val = Any  # ffi.wasmtime_component_val_t
RawHandler = Callable[[Any, Any], Val | None]  # (context pointer, args array) -> result value


def borrow_rep(context: Any, val: Val) -> int:
    """The host rep of a `borrow<T>` argument of a host resource type."""
    if val.kind != ffi.WASMTIME_COMPONENT_RESOURCE.value:
        raise wasmtime.WasmtimeError("expected a resource handle")
    host = POINTER(ffi.wasmtime_component_resource_host_t)()
    error = ffi.wasmtime_component_resource_any_to_host(context, val.of.resource, byref(host))
    if error:
        raise wasmtime.WasmtimeError._from_ptr(error)
    try:
        rep: int = ffi.wasmtime_component_resource_host_rep(host)
    finally:
        ffi.wasmtime_component_resource_host_delete(host)
    return rep


def u32_list(val: Val) -> list[int]:
    if val.kind != ffi.WASMTIME_COMPONENT_LIST.value:
        raise wasmtime.WasmtimeError("expected a list")
    data = val.of.list.data
    return [data[i].of.u32 for i in range(val.of.list.size)]


def list_items(val: Val) -> list[Val]:
    """The elements of a list (still owned by `val`)."""
    if val.kind != ffi.WASMTIME_COMPONENT_LIST.value:
        raise wasmtime.WasmtimeError("expected a list")
    data = val.of.list.data
    return [data[i] for i in range(val.of.list.size)]


def list_len(val: Val) -> int:
    if val.kind != ffi.WASMTIME_COMPONENT_LIST.value:
        raise wasmtime.WasmtimeError("expected a list")
    size: int = val.of.list.size
    return size


def record_values(val: Val) -> list[Val]:
    """The field values of a record, in WIT declaration order (still owned by `val`)."""
    if val.kind != ffi.WASMTIME_COMPONENT_RECORD.value:
        raise wasmtime.WasmtimeError("expected a record")
    data = val.of.record.data
    return [data[i].val for i in range(val.of.record.size)]


def option_value(val: Val) -> Val | None:
    """The value inside an `option<T>` (still owned by `val`), or None."""
    if val.kind != ffi.WASMTIME_COMPONENT_OPTION.value:
        raise wasmtime.WasmtimeError("expected an option")
    return val.of.option[0] if val.of.option else None


def tuple_values(val: Val) -> list[Val]:
    """The values of a tuple (still owned by `val`)."""
    if val.kind != ffi.WASMTIME_COMPONENT_TUPLE.value:
        raise wasmtime.WasmtimeError("expected a tuple")
    data = val.of.tuple.data
    return [data[i] for i in range(val.of.tuple.size)]


def enum_name(val: Val) -> str:
    return ffi.to_str(val.of.enumeration)


def u32(value: int) -> Val:
    out = ffi.wasmtime_component_val_t()
    out.kind = ffi.WASMTIME_COMPONENT_U32
    out.of.u32 = value
    return out


def ok_u32(value: int) -> Val:
    inner = ffi.wasmtime_component_val_t()
    inner.kind = ffi.WASMTIME_COMPONENT_U32
    inner.of.u32 = value
    out = ffi.wasmtime_component_val_t()
    out.kind = ffi.WASMTIME_COMPONENT_RESULT
    out.of.result.is_ok = True
    out.of.result.val = ffi.wasmtime_component_val_new(byref(inner))
    return out


def err_string(message: str) -> Val:
    inner = ffi.wasmtime_component_val_t()
    inner.kind = ffi.WASMTIME_COMPONENT_STRING
    inner.of.string = ffi.str_to_capi(message)
    out = ffi.wasmtime_component_val_t()
    out.kind = ffi.WASMTIME_COMPONENT_RESULT
    out.of.result.is_ok = False
    out.of.result.val = ffi.wasmtime_component_val_new(byref(inner))
    return out


def results_u32(values: list[int | str]) -> Val:
    """A `list<result<u32, string>>`: an int is ok, a str an error."""
    items = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(items, len(values))
    for i, value in enumerate(values):
        items.data[i] = err_string(value) if isinstance(value, str) else ok_u32(value)
    out = ffi.wasmtime_component_val_t()
    out.kind = ffi.WASMTIME_COMPONENT_LIST
    out.of.list = items
    return out


def _error_pointer(message: str) -> int:
    error = wasmtime.WasmtimeError(message)
    pointer: int = ctypes.cast(error._consume(), ctypes.c_void_p).value or 0
    return pointer


# ctypes callbacks must outlive the Linker: wasmtime calls them until the process ends.
_KEEP_ALIVE: list[Any] = []


def _finalize_nothing(_env: Any) -> None:
    return None


_no_finalizer = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_finalize_nothing)


def add_raw_func(instance: LinkerInstance, name: str, handler: RawHandler, num_args: int) -> None:
    """Register `handler` for function `name`, which takes `num_args` arguments. It gets the
    call's context pointer and the raw argument array; it returns the result value (or None for
    a function without one) and may raise `wasmtime.WasmtimeError` to trap the guest. It must not
    free or keep the arguments. A component may import the name with any signature (wasmtime
    lifts what the component declares): a call with another number of arguments or results
    traps before the handler reads any, and the helpers above check each value's kind."""

    def callback(_env: Any, context: Any, _ty: Any, args: Any, nargs: int, results: Any, nresults: int) -> int:
        if nargs != num_args or nresults > 1:
            return _error_pointer(f"{name} takes {num_args} arguments and returns at most one value")
        try:
            value = handler(context, args)
            if nresults:
                if value is None:
                    return _error_pointer(f"host function {name} returned no value")
                ctypes.pointer(results[0])[0] = value
            return 0
        except wasmtime.WasmtimeError as exc:
            return _error_pointer(str(exc))
        except Exception as exc:  # nothing may unwind through a C callback
            _log.exception("raw host function %s failed", name)
            return _error_pointer(f"host error in {name}: {type(exc).__name__}: {exc}")

    raw = ffi.wasmtime_component_func_callback_t(callback)
    _KEEP_ALIVE.append(raw)
    name_bytes = name.encode("utf-8")
    error = ffi.wasmtime_component_linker_instance_add_func(
        instance.ptr(), ctypes.create_string_buffer(name_bytes), len(name_bytes), raw, None, _no_finalizer
    )
    if error:
        raise wasmtime.WasmtimeError._from_ptr(error)
