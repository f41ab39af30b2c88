"""The engines `wafer dev` runs its inferlet on: one per driver (replicas when there are several),
each checked before every run and restarted when its driver was lost, so that one crashed driver
does not end the loop. Knows nothing of builds, the sandbox or the console.

A run lives on one replica, so a driver lost during a run fails that run (the others keep
serving); what a supervisor can do is bring the driver back before the next run, here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from host.engine import Engine, EngineConfig, ReplicatedEngine
from host.engine.replica_start import start_engines
from host.errors import HostError


@dataclass(slots=True)
class _Slot:
    config: EngineConfig
    name: str  # "replica 1", or "the driver" when there is one
    engine: Engine | None
    fresh: EngineConfig | None  # a kept driver's: the built-in one to start if it cannot be reached
    generation: int = 1  # one more at every restart: the replicated engine sees a new driver

    @property
    def label(self) -> str:
        return f"{self.name} ({self.config.driver})"


def _current(slot: _Slot) -> tuple[Engine, int] | None:
    return None if slot.engine is None else (slot.engine, slot.generation)


class DevEngines:
    """`DevEngines.start(configs, say)`; before each run `for_next_run()` gives the engine to run
    on, or None when no driver could be brought back (`say` has told why)."""

    def __init__(
        self,
        configs: Sequence[EngineConfig],
        engines: Sequence[Engine],
        say: Callable[[str], None],
        fresh: Sequence[EngineConfig | None] = (),
    ) -> None:
        several = len(configs) > 1
        fresh = list(fresh) or [None] * len(configs)
        self._slots = [
            _Slot(config, f"replica {i}" if several else "the driver", engine, f)
            for i, (config, engine, f) in enumerate(zip(configs, engines, fresh, strict=True))
        ]
        self._say = say
        sources = [functools.partial(_current, slot) for slot in self._slots]
        self._replicated = ReplicatedEngine(sources) if several else None

    @classmethod
    def start(
        cls, configs: Sequence[EngineConfig], say: Callable[[str], None], fresh: Sequence[EngineConfig | None] = ()
    ) -> DevEngines:
        """Start every driver; a failed first start is the caller's error (`HostError`), not retried.
        `fresh[i]`, where given, is started instead of `configs[i]` (a kept driver's address) once
        that one is lost and cannot be reached again."""
        engines = [Engine.start(configs[0])] if len(configs) == 1 else start_engines(configs)
        return cls(configs, engines, say, fresh)

    def __enter__(self) -> DevEngines:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for slot in self._slots:
            if slot.engine is not None:
                slot.engine.close()
                slot.engine = None

    @property
    def generations(self) -> list[int]:
        """Each driver's generation (1 at the start, one more at each restart)."""
        return [slot.generation for slot in self._slots]

    def for_next_run(self) -> Engine | ReplicatedEngine | None:
        """Check every driver with a health round trip (a dead process is noticed by the next
        message to it, not before); restart each that fails it. The engine runs use: the one
        driver's, or the replicated one over every driver that is up."""
        for slot in self._slots:
            self._check(slot)
        if self._replicated is None:
            return self._slots[0].engine
        return self._replicated if any(slot.engine is not None for slot in self._slots) else None

    def _check(self, slot: _Slot) -> None:
        if slot.engine is not None:
            try:
                slot.engine.driver_health()
                return
            except HostError as exc:
                self._say(f"{slot.label} was lost ({exc}): restarting it")
                slot.engine.close()
                slot.engine = None
        try:
            slot.engine = Engine.start(slot.config)
        except HostError as exc:
            if slot.fresh is None:
                self._say(f"{slot.label} did not restart ({exc}); trying again before the next run")
                return
            self._say(f"{slot.label} cannot be reached ({exc}): starting a {slot.fresh.driver} driver instead")
            slot.config, slot.fresh = slot.fresh, None
            self._check(slot)
            return
        slot.generation += 1
        self._say(f"{slot.label} restarted")
