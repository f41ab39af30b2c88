"""`wasi:clocks/monotonic-clock` for guests, in place of WASI's own: the clock reads as usual, but
a guest cannot wait on it. WASI's waits (`time.sleep`, a `select` or `poll` with a timeout) block
inside wasmtime, out of reach of the epoch watchdog, the wall clock and cancel: a sleeping guest
held its run slot for as long as it asked. Subscribing to the clock is refused instead, with an
error that says what to do; a guest waits for its client with `receive()`, which the host bounds.
"""

from __future__ import annotations

import time

import wasmtime
from wasmtime.component import LinkerInstance

# Registered at every WASI version a component may import (`imports.WASI_VERSIONS`): wasmtime's
# linker would match any other 0.2 version to its own clock, whose waits block.
INTERFACE = "wasi:clocks/monotonic-clock"
_RESOLUTION_NS = max(1, int(time.get_clock_info("monotonic").resolution * 1e9))
REFUSAL = (
    "inferlets cannot sleep or wait on a clock (time.sleep, select or poll with a timeout): such a wait "
    "would escape the run's time limits and cancel; wait for client messages with receive() instead"
)


def now(_store: wasmtime.StoreContext) -> int:
    return time.monotonic_ns()


def resolution(_store: wasmtime.StoreContext) -> int:
    return _RESOLUTION_NS


def subscribe(_store: wasmtime.StoreContext, _when: int) -> None:
    raise wasmtime.WasmtimeError(REFUSAL)


def register(instance: LinkerInstance) -> None:
    instance.add_func("now", now)
    instance.add_func("resolution", resolution)
    instance.add_func("subscribe-instant", subscribe)
    instance.add_func("subscribe-duration", subscribe)
