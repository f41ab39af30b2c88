"""The one wasmtime Engine (epoch interruption on) and the ticker thread that advances its epoch."""

from __future__ import annotations

import threading
from importlib.metadata import version

import wasmtime

from host.sandbox.config import SandboxConfig

WASMTIME_VERSION = version("wasmtime")

# Compiled code depends on these; they are part of the compile-cache key.
ENGINE_FLAGS = "epoch_interruption=1"


def new_engine() -> wasmtime.Engine:
    config = wasmtime.Config()
    config.epoch_interruption = True
    return wasmtime.Engine(config)


class EpochTicker:
    """A daemon thread calling `engine.increment_epoch()` every `epoch_tick_s`."""

    def __init__(self, engine: wasmtime.Engine, config: SandboxConfig) -> None:
        self._engine = engine
        self._tick_s = config.epoch_tick_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="wafer-epoch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stopped.wait(self._tick_s):
            self._engine.increment_epoch()
