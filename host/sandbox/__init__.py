"""The wasmtime sandbox that runs inferlets: one Engine and Linker, one thread and Store per run.

It owns isolation (epoch watchdog, memory cap, WASI with nothing granted) and resource tracking;
it knows nothing of pages, batching or the bridge (host functions talk to `host.services`).
"""

from __future__ import annotations

from host.sandbox.compile_cache import LoadedInferlet
from host.sandbox.config import SandboxConfig
from host.sandbox.errors import ComponentLoadError, SandboxError
from host.sandbox.outcome import RunOutcome, RunStatus
from host.sandbox.run_io import BufferedRunIO, RunIO
from host.sandbox.sandbox import RunHandle, Sandbox

__all__ = [
    "BufferedRunIO",
    "ComponentLoadError",
    "LoadedInferlet",
    "RunHandle",
    "RunIO",
    "RunOutcome",
    "RunStatus",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
]
