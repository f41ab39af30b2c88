"""Driver replicas: several engines (`Engine`, one per driver, each with its own scheduler, page
table and speculator) behind the one interface a run uses (`host.services.Services`, plus what
the daemon reads of an engine).

A run is placed on one replica at its first pass (or fork, or adapter load), by prefix affinity,
load and free pages (host.engine.placement); every context it makes lives there, forks with their
parent. Until then its contexts exist only here: they are empty, and are made on the replica when
the run is placed. Context ids are this layer's, unique across replicas, and each replica's
engine is handed them, so its errors name the ids the run knows. A replica that fails
fails the runs placed on it (their calls raise its engine's error); the others keep serving, and
later runs are placed on the replicas that are up.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bridge_schema.messages import Handshake
from host.engine.config import EngineConfig
from host.engine.facade import Engine
from host.engine.placement import AffinityIndex, Candidate, choose
from host.engine.prefix_cache import page_keys
from host.engine.replica_rules import disagreement, in_group_order, summed
from host.engine.replica_start import start_engines
from host.errors import ContextNotFound, ContextNotOwned, DriverFailed, EngineClosed, HostError
from host.services import ModelInfo, NextStep, PassRequest, PassResult, Tokenizer

if TYPE_CHECKING:
    from host.grammar import GrammarCompiler

log = logging.getLogger("host.engine.replicas")

# A replica's engine now and its generation (a new one at each restart), or None while it is down.
ReplicaSource = Callable[[], tuple[Engine, int] | None]
# Placements remembered after their runs end (the daemon asks why an ended run failed).
MAX_KEPT_PLACEMENTS = 4096


@dataclass(slots=True)
class _Context:
    run_id: int  # made on the run's replica once the run is placed (under the same id)
    is_fresh: bool = True  # no pass yet: its first one names a prompt for affinity


@dataclass(slots=True)
class _Run:
    contexts: set[int] = field(default_factory=set)
    index: int = -1  # the replica, once placed
    engine: Engine | None = None
    generation: int = 0
    group: str | None = None


class ReplicatedEngine:
    """`ReplicatedEngine.start([EngineConfig(...), ...])` starts one engine per configuration
    (and closes them); `ReplicatedEngine(sources)` serves engines someone else starts and
    restarts (the daemon's supervisors)."""

    def __init__(self, sources: Sequence[ReplicaSource], owned: Sequence[Engine] = ()) -> None:
        if not sources:
            raise ValueError("a replicated engine needs at least one replica")
        self._sources = tuple(sources)
        self._owned = tuple(owned)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._contexts: dict[int, _Context] = {}
        self._runs: dict[int, _Run] = {}
        self._placed: OrderedDict[int, tuple[int, int]] = OrderedDict()  # run -> (replica, generation)
        self._num_runs: Counter[tuple[int, int]] = Counter()  # (replica, generation) -> runs placed, not ended
        self._affinity = [AffinityIndex() for _ in self._sources]
        self._seen: list[int | None] = [None] * len(self._sources)  # the generation last looked at
        # (replica, generation) never chosen again: it serves another model, or its driver was lost
        self._left_out: set[tuple[int, int]] = set()
        self._first: Engine | None = None  # the first replica seen: the model every replica must serve

    @classmethod
    def start(cls, configs: Sequence[EngineConfig]) -> ReplicatedEngine:
        """Start every replica's driver at once (`start_engines`); this engine closes them."""
        engines = start_engines(configs)
        return cls([functools.partial(_fixed, engine) for engine in engines], owned=engines)

    def __enter__(self) -> ReplicatedEngine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for engine in self._owned:
            engine.close()

    # ------------------------------------------------------------------ the replicas

    @property
    def num_replicas(self) -> int:
        return len(self._sources)

    def replicas(self) -> list[Engine | None]:
        """Each replica's engine, None while it is down, once it was lost (until it restarts), or
        when it serves another model than the first."""
        with self._lock:
            live = dict((index, engine) for index, engine, _ in self._live())
        return [live.get(index) for index in range(len(self._sources))]

    def placement(self, run_id: int) -> tuple[int, int] | None:
        """(replica, its generation) the run was placed on, kept a while after the run ends;
        None if it never was (it made no pass)."""
        with self._lock:
            return self._placed.get(run_id)

    def replica_of(self, run_id: int, context_id: int) -> int:
        """The replica the context lives on (-1 while its run is not placed)."""
        with self._lock:
            self._owned_context(run_id, context_id)
            return self._runs[run_id].index

    def _live(self) -> list[tuple[int, Engine, int]]:
        """(index, engine, generation) of every replica up now that serves the first one's model."""
        live = []
        for index, source in enumerate(self._sources):
            if (found := source()) is None:
                continue
            engine, generation = found
            if self._seen[index] != generation:
                self._seen[index] = generation
                self._affinity[index].clear()  # a new driver: its cache is empty
                if self._first is None:
                    self._first = engine
                elif mismatch := disagreement(self._first.handshake, engine.handshake):
                    log.error("replica %d left out: it %s", index, mismatch)
                    self._left_out.add((index, generation))
            if (index, generation) not in self._left_out:
                live.append((index, engine, generation))
        return live

    def _reference(self) -> Engine:
        with self._lock:
            if self._first is None:
                self._live()
            if self._first is None:
                raise DriverFailed("no replica is up yet")
            return self._first

    # ------------------------------------------------------------------ the model (every replica's)

    @property
    def handshake(self) -> Handshake:
        return self._reference().handshake

    @property
    def model(self) -> ModelInfo:
        return self._reference().model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._reference().tokenizer

    def grammars(self) -> GrammarCompiler:
        # The compiler depends only on the tokenizer, which every replica shares.
        return self._reference().grammars()

    def max_decode_steps(self) -> int:
        with self._lock:
            live = self._live()
        return min((engine.max_decode_steps() for _, engine, _ in live), default=1)

    # ------------------------------------------------------------------ totals over the replicas up

    def speculation_stats(self) -> dict[str, int]:
        return summed(engine.speculation_stats() for engine in self._engines())

    def prefix_stats(self) -> dict[str, int]:
        return summed(engine.prefix_stats() for engine in self._engines())

    def timing_stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for engine in self._engines():
            for key, value in engine.timing_stats().items():
                out[key] = out.get(key, 0.0) + value
        return out

    def driver_health(self) -> dict[str, int | float | str]:
        """The drivers' numeric counters summed (`DriverFailed` if a replica up does not answer)."""
        out: dict[str, int | float | str] = {}
        for engine in self._engines():
            for key, value in engine.driver_health().items():
                if isinstance(value, int | float):
                    previous = out.get(key, 0)
                    out[key] = (previous if isinstance(previous, int | float) else 0) + value
        return out

    @property
    def num_pages(self) -> int:
        return sum(engine.num_pages for engine in self._engines())

    @property
    def num_free_pages(self) -> int:
        return sum(engine.num_free_pages for engine in self._engines())

    @property
    def num_available_pages(self) -> int:
        return sum(engine.num_available_pages for engine in self._engines())

    # ------------------------------------------------------------------ contexts

    def create_context(self, run_id: int) -> int:
        with self._lock:
            run = self._runs.setdefault(run_id, _Run())
            context_id = next(self._ids)
            if run.engine is not None:
                run.engine.create_context(run_id, context_id)
            else:
                self._check_any_up()
            self._contexts[context_id] = _Context(run_id)
            run.contexts.add(context_id)
            return context_id

    def fork_context(self, run_id: int, context_id: int) -> int:
        with self._lock:
            engine = self._bound(run_id, context_id, None)
            child = engine.fork_context(run_id, context_id, next(self._ids))
            self._contexts[child] = _Context(run_id, self._contexts[context_id].is_fresh)
            self._runs[run_id].contexts.add(child)
            return child

    def set_run_group(self, run_id: int, group: str) -> None:
        with self._lock:
            run = self._runs.setdefault(run_id, _Run())
            run.group = group
            if run.engine is not None:
                run.engine.set_run_group(run_id, group)

    def context_length(self, run_id: int, context_id: int) -> int:
        return self._call(run_id, context_id, Engine.context_length)

    def context_num_pages(self, run_id: int, context_id: int) -> int:
        return self._call(run_id, context_id, Engine.context_num_pages)

    def truncate_context(self, run_id: int, context_id: int, length: int) -> None:
        with self._lock:
            engine = self._bound(run_id, context_id, None)
        engine.truncate_context(run_id, context_id, length)

    def release_context(self, run_id: int, context_id: int) -> None:
        with self._lock:
            self._owned_context(run_id, context_id)
            engine = self._runs[run_id].engine
            del self._contexts[context_id]
            self._runs[run_id].contexts.discard(context_id)
        if engine is not None:
            engine.release_context(run_id, context_id)

    def release_slots(self, run_id: int, context_id: int, start: int, stop: int) -> int:
        with self._lock:
            engine = self._bound(run_id, context_id, None)
        return engine.release_slots(run_id, context_id, start, stop)

    def end_run(self, run_id: int) -> None:
        with self._lock:
            run = self._runs.pop(run_id, None)
            if run is None:
                return
            for context_id in run.contexts:
                del self._contexts[context_id]
            if run.engine is not None:
                self._num_runs[(run.index, run.generation)] -= 1
        if run.engine is not None:
            run.engine.end_run(run_id)

    def run_usage(self, run_id: int) -> tuple[int, int]:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return 0, 0
            if run.engine is None:
                return len(run.contexts), 0
            engine = run.engine
        return engine.run_usage(run_id)

    def run_num_tokens(self, run_id: int) -> int:
        with self._lock:
            run = self._runs.get(run_id)
            engine = run.engine if run is not None else None
        return engine.run_num_tokens(run_id) if engine is not None else 0

    # ------------------------------------------------------------------ passes

    def forward(
        self, run_id: int, context_id: int, request: PassRequest, may_wait: Callable[[], None] | None = None
    ) -> PassResult:
        with self._lock:
            engine = self._bound(run_id, context_id, request)
        return engine.forward(run_id, context_id, request, may_wait)

    def forward_group(
        self, run_id: int, passes: Sequence[tuple[int, PassRequest]], may_wait: Callable[[], None] | None = None
    ) -> list[PassResult | HostError]:
        """On the run's replica (every context of a run lives on one), as one group there."""
        refused: list[HostError | None] = []  # why a pass is not sent, or None
        engine: Engine | None = None
        with self._lock:
            for context_id, request in passes:
                try:
                    engine = self._bound(run_id, context_id, request)
                    refused.append(None)
                except HostError as exc:
                    refused.append(exc)
        sent = [p for p, why in zip(passes, refused, strict=True) if why is None]
        return in_group_order(refused, engine.forward_group(run_id, sent, may_wait) if engine is not None else [])

    def generate(self, run_id: int, context_id: int, first: PassRequest, next_step: NextStep) -> None:
        with self._lock:
            engine = self._bound(run_id, context_id, first)
        engine.generate(run_id, context_id, first, next_step)

    def load_adapter(self, run_id: int, name: str) -> int:
        """Loaded on the run's replica (placing the run now if it is not placed yet)."""
        with self._lock:
            run = self._runs.setdefault(run_id, _Run())
            if run.engine is None:
                self._place(run_id, run, None)
            assert run.engine is not None
            engine = run.engine
        return engine.load_adapter(run_id, name)

    # ------------------------------------------------------------------ routing and placement

    def _owned_context(self, run_id: int, context_id: int) -> _Context:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise ContextNotFound(context_id)
        if ctx.run_id != run_id:
            raise ContextNotOwned(context_id, run_id)
        return ctx

    def _call(self, run_id: int, context_id: int, verb: Callable[[Engine, int, int], int]) -> int:
        """A read of a context: an unplaced one is empty."""
        with self._lock:
            self._owned_context(run_id, context_id)
            engine = self._runs[run_id].engine
        if engine is None:
            return 0
        return verb(engine, run_id, context_id)

    def _bound(self, run_id: int, context_id: int, request: PassRequest | None) -> Engine:
        """The context's engine, placing its run first if it is not placed (by
        `request`'s prompt, when it is the first pass). Lock held."""
        ctx = self._owned_context(run_id, context_id)
        run = self._runs[run_id]
        names = self._prompt_names(request) if request is not None and ctx.is_fresh else []
        if run.engine is None:
            self._place(run_id, run, names)
        assert run.engine is not None
        if names and run.engine.config.prefix_match_unit:
            self._affinity[run.index].add(names)
        if request is not None:
            ctx.is_fresh = False
        return run.engine

    def _place(self, run_id: int, run: _Run, names: Sequence[bytes] | None) -> None:
        """Choose the run's replica and make its contexts there; a replica that turns out to be
        down is left out (until it restarts: a new generation) and the next one chosen."""
        while True:
            live = {index: (engine, generation) for index, engine, generation in self._live()}
            if not live:
                raise DriverFailed("no model driver replica is up: retry once one has restarted")
            chosen = choose(
                [
                    Candidate(
                        index,
                        self._num_runs[(index, generation)],
                        engine.num_available_pages,
                        self._affinity[index].matched(names) if names else 0,
                    )
                    for index, (engine, generation) in live.items()
                ]
            )
            engine, generation = live[chosen.index]
            try:
                if run.group is not None:
                    engine.set_run_group(run_id, run.group)
                for context_id in sorted(run.contexts):
                    engine.create_context(run_id, context_id)
            except (DriverFailed, EngineClosed) as exc:
                log.warning("replica %d is down (%s): placing run %d elsewhere", chosen.index, exc, run_id)
                engine.end_run(run_id)
                self._affinity[chosen.index].clear()
                self._left_out.add((chosen.index, generation))
                continue
            run.index, run.engine, run.generation = chosen.index, engine, generation
            self._num_runs[(chosen.index, generation)] += 1
            self._placed[run_id] = (chosen.index, generation)
            while len(self._placed) > MAX_KEPT_PLACEMENTS:
                self._placed.popitem(last=False)
            return

    def _prompt_names(self, request: PassRequest) -> list[bytes]:
        """The names of the full pages of a context's first pass (as host.engine.prefix names
        them)."""
        if self._first is None or not self._first.config.prefix_match_unit:
            return []  # prefix reuse off: no prompt is cached anywhere
        page_size = self._first.model.page_size
        tokens = [int(t) for t in request.tokens]
        num = len(tokens) // page_size * page_size
        positions = [int(p) for p in request.positions] if request.positions is not None else list(range(len(tokens)))
        return page_keys(tokens[:num], positions[:num], [request.adapter_id] * num, page_size)

    def _check_any_up(self) -> None:
        if not self._live():
            raise DriverFailed("no model driver replica is up: retry once one has restarted")

    def _engines(self) -> list[Engine]:
        with self._lock:
            return [engine for _, engine, _ in self._live()]


def _fixed(engine: Engine) -> tuple[Engine, int]:
    return engine, 1
