"""Which imports a component may have: the wafer world, and the WASI interfaces wafer has vetted
at the versions it has vetted. Anything else is refused when the component loads, naming it.

wasmtime's linker matches any `wasi:*@0.2.x` import to its own WASI by semver, so a shadowing
implementation registered at one version (`clocks.py`) does not cover the others: a hand-built
component importing the monotonic clock at 0.2.0 got wasmtime's, slept in `pollable.block` out of
reach of the watchdog, the wall clock and cancel. Every version listed here is shadowed where
wafer replaces the interface, and versions not listed are refused, so a new WASI release cannot
bring an unvetted wait in.
"""

from __future__ import annotations

import re

import wasmtime
from wasmtime.component import Component

from host.api import PACKAGE, VERSION
from host.sandbox.errors import ComponentLoadError

# The WASI 0.2 releases wafer has checked: every blocking call in them either cannot start (the
# clock's subscriptions are refused, `clocks.py`; sockets cannot bind, connect or look up names;
# there are no files) or waits on something the host drains (the guest's output pipes).
WASI_VERSIONS: tuple[str, ...] = tuple(f"0.2.{minor}" for minor in range(10))

# What componentize-py's guests import (through its WASI adapter), plus the other non-blocking
# parts of WASI 0.2. `wasi:http` is absent: wafer links no HTTP.
WASI_INTERFACES: frozenset[str] = frozenset(
    {
        "wasi:cli/environment",
        "wasi:cli/exit",
        "wasi:cli/stdin",
        "wasi:cli/stdout",
        "wasi:cli/stderr",
        "wasi:cli/terminal-input",
        "wasi:cli/terminal-output",
        "wasi:cli/terminal-stdin",
        "wasi:cli/terminal-stdout",
        "wasi:cli/terminal-stderr",
        "wasi:clocks/monotonic-clock",
        "wasi:clocks/wall-clock",
        "wasi:filesystem/types",
        "wasi:filesystem/preopens",
        "wasi:io/error",
        "wasi:io/poll",
        "wasi:io/streams",
        "wasi:random/random",
        "wasi:random/insecure",
        "wasi:random/insecure-seed",
        "wasi:sockets/network",
        "wasi:sockets/instance-network",
        "wasi:sockets/ip-name-lookup",
        "wasi:sockets/tcp",
        "wasi:sockets/tcp-create-socket",
        "wasi:sockets/udp",
        "wasi:sockets/udp-create-socket",
    }
)

WAFER_INTERFACES: frozenset[str] = frozenset({"runtime", "model", "context", "adapter", "grammar", "inference"})

_VERSIONED = re.compile(r"^(?P<name>[a-z][a-z0-9-]*:[a-z0-9-]+/[a-z0-9-]+)@(?P<version>[0-9A-Za-z.+-]+)$")


def import_problem(name: str) -> str | None:
    """Why the import `name` is refused, or None when wafer provides it."""
    match = _VERSIONED.match(name)
    if match is None:
        return "not an interface of the wafer world or of WASI 0.2"
    interface, version = match["name"], match["version"]
    if interface.startswith(f"{PACKAGE}/"):
        if interface.removeprefix(f"{PACKAGE}/") not in WAFER_INTERFACES:
            return f"{PACKAGE} has no interface {interface.removeprefix(PACKAGE + '/')!r}"
        if version != VERSION:
            return f"wafer provides {PACKAGE} at {VERSION} only"
        return None
    if interface.startswith("wasi:"):
        if interface not in WASI_INTERFACES:
            return "wafer does not provide this WASI interface"
        if version not in WASI_VERSIONS:
            return f"wafer provides WASI at {WASI_VERSIONS[0]} to {WASI_VERSIONS[-1]} only"
        return None
    return "not an interface of the wafer world or of WASI 0.2"


def check_imports(component: Component, engine: wasmtime.Engine, where: str) -> None:
    """Raise ComponentLoadError naming every import of `component` that wafer does not provide."""
    refused = [
        f"{name} ({problem})"
        for name in component.type.imports(engine)
        if (problem := import_problem(name)) is not None
    ]
    if refused:
        raise ComponentLoadError(f"{where} imports what wafer does not provide: {'; '.join(refused)}")
