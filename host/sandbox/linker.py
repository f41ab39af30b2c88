"""The one Linker: WASI (nothing granted; that is decided per Store) plus every host interface.

It must be complete before the first instantiate: an open `root()` block makes instantiation fail.
"""

from __future__ import annotations

import wasmtime
from wasmtime.component import Linker


def new_linker(engine: wasmtime.Engine) -> Linker:
    # Imported here, not at the top: the host modules import `host.sandbox.run_state`, and this
    # package's __init__ imports this module, so a top-level import would be circular whenever
    # `host.api` is imported first.
    from host.api import adapter, context, grammar, inference, interface_name, model, runtime
    from host.sandbox import clocks
    from host.sandbox.imports import WASI_VERSIONS

    linker = Linker(engine)
    linker.add_wasip2()
    linker.allow_shadowing = True  # our monotonic clock replaces WASI's (clocks.py)
    with linker.root() as root:
        for version in WASI_VERSIONS:
            with root.add_instance(f"{clocks.INTERFACE}@{version}") as instance:
                clocks.register(instance)
        for module in (runtime, model, context, adapter, grammar, inference):
            with root.add_instance(interface_name(module.INTERFACE)) as instance:
                module.register(instance)
    return linker
