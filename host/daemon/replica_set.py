"""The daemon's drivers: one `Supervisor` per replica (each starts, watches and restarts its own),
and the engine runs are given: the one replica's `Engine`, or a `ReplicatedEngine` over every
replica's. Knows nothing of HTTP or runs.
"""

from __future__ import annotations

import functools
import time

from host.daemon.config import DaemonConfig
from host.daemon.errors import DaemonError, DriverUnavailable
from host.daemon.supervisor import DriverState, DriverStatus, Supervisor
from host.engine import Engine, ReplicatedEngine

_POLL_S = 0.05  # how often replicas are looked at while waiting for one to be up

AnyEngine = Engine | ReplicatedEngine


class ReplicaSet:
    def __init__(self, config: DaemonConfig) -> None:
        drivers = config.replica_drivers
        self.supervisors = tuple(Supervisor(config, driver=d, index=i) for i, d in enumerate(drivers))
        sources = [functools.partial(_live, s) for s in self.supervisors]
        self._replicated = ReplicatedEngine(sources) if len(drivers) > 1 else None

    def start(self) -> None:
        for supervisor in self.supervisors:
            supervisor.start()

    def stop(self) -> None:
        """Close every engine and stop every driver; idempotent."""
        for supervisor in self.supervisors:
            supervisor.stop()

    @property
    def is_stopping(self) -> bool:
        return self.supervisors[0].is_stopping

    def statuses(self) -> list[DriverStatus]:
        return [supervisor.status() for supervisor in self.supervisors]

    def status(self) -> DriverStatus:
        """The one replica's status, or of several: ready while any is, restarts and generations
        summed, each replica's last error named."""
        if self._replicated is None:
            return self.supervisors[0].status()
        statuses = self.statuses()
        ready = [s for s in statuses if s.state is DriverState.READY]
        errors = "; ".join(f"replica {i}: {s.last_error}" for i, s in enumerate(statuses) if s.last_error)
        return DriverStatus(
            DriverState.READY if ready else statuses[0].state,
            None,
            sum(s.num_restarts for s in statuses),
            errors,
            sum(s.generation for s in statuses),
        )

    def engine(self, timeout_s: float = 0.0) -> tuple[AnyEngine, int]:
        """The engine runs use and its generation, waiting up to `timeout_s` for a replica to be
        up (`DriverUnavailable` if none is). Over several replicas the generation is 0: a run's
        own replica and generation are the replicated engine's `placement`."""
        if self._replicated is None:
            return self.supervisors[0].engine(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            if any(_live(s) is not None for s in self.supervisors):
                return self._replicated, 0
            if self.is_stopping or time.monotonic() >= deadline:
                errors = "; ".join(
                    f"replica {i}: {s.state.value} {s.last_error}" for i, s in enumerate(self.statuses())
                )
                raise DriverUnavailable(f"no model driver replica is up ({errors})")
            time.sleep(_POLL_S)

    def replica_engines(self) -> list[Engine | None]:
        """Each replica's engine now: None while it is down, or (of several) while runs are not
        placed on it (it serves another model than the first, or was lost and not restarted yet)."""
        if self._replicated is not None:
            return self._replicated.replicas()
        return [found[0] if (found := _live(s)) is not None else None for s in self.supervisors]

    def lost_reason(self, generation: int, run_id: int) -> str:
        """Why the engine a run ran on is gone, or "" if it still looks alive (or the run was
        never placed on a replica)."""
        if self._replicated is None:
            return self.supervisors[0].lost_reason(generation)
        placed = self._replicated.placement(run_id)
        if placed is None:
            return ""
        index, replica_generation = placed
        reason = self.supervisors[index].lost_reason(replica_generation)
        return f"replica {index}: {reason}" if reason else ""


def _live(supervisor: Supervisor) -> tuple[Engine, int] | None:
    try:
        return supervisor.engine(0.0)
    except DaemonError:
        return None
