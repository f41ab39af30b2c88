"""Starting replicas: one engine per driver configuration, all at once, and checked to serve the
same model (host.engine.replica_rules) before any serves a run."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

from host.engine.config import EngineConfig
from host.engine.facade import Engine
from host.engine.replica_rules import disagreement
from host.errors import DriverFailed


def start_engines(configs: Sequence[EngineConfig]) -> list[Engine]:
    """One engine per configuration, started at once; `DriverFailed` (the others closed) if one
    does not start or serves another model or vocabulary than the first."""
    with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
        futures = [pool.submit(Engine.start, config) for config in configs]
    engines = [f.result() for f in futures if f.exception() is None]
    try:
        for index, f in enumerate(futures):
            if (error := f.exception()) is not None:
                raise DriverFailed(f"replica {index} ({configs[index].driver}) did not start: {error}")
        for index, engine in enumerate(engines[1:], 1):
            if mismatch := disagreement(engines[0].handshake, engine.handshake):
                raise DriverFailed(f"replica {index} ({configs[index].driver}) {mismatch}")
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines
