"""The thread-facing engine: `host.services.Services` for the run threads (blocking,
thread-safe), over the thread-free core (host.engine.core) and the loop thread that drives it
(host.engine.loop). Every method takes the engine's lock around one core verb, then wakes the
loop if there is new work.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from bridge_schema.messages import Ack, Adapter, Handshake, Health, HealthReply
from host.engine.adapters import AdapterNameError, AdapterSlotsFull, AdapterTable, resolve
from host.engine.chain import Chain
from host.engine.config import EngineConfig
from host.engine.core import EngineCore
from host.engine.lock import EngineLock
from host.engine.loop import EngineLoop
from host.errors import FeatureUnavailable, HostError, InvalidRequest
from host.services import ModelInfo, NextStep, PassRequest, PassResult, Tokenizer
from host.waiting import result_in_slices

if TYPE_CHECKING:
    from host.grammar import GrammarCompiler


GROUP_SLICE = 32  # passes of a group queued under one hold of the engine's lock


class Engine:
    """Use `Engine.start(EngineConfig(...))`; `close()` (or a `with` block) stops the loop and
    the driver."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._lock = EngineLock()
        self._loop = EngineLoop(config, self._lock)
        self._adapters = AdapterTable(config.max_loaded_adapters)  # loaded on the driver, shared by runs
        self._adapter_lock = threading.Lock()
        self._grammar_lock = threading.Lock()
        self._grammar_compiler: GrammarCompiler | None = None

    @classmethod
    def start(cls, config: EngineConfig | None = None) -> Engine:
        """Start (or connect to) the driver and wait for its handshake (`DriverFailed` with the
        driver's output when it does not come)."""
        engine = cls(config or EngineConfig())
        engine._core = engine._loop.start()
        return engine

    _core: EngineCore

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Fail waiting passes with `EngineClosed`, shut the driver down, stop the loop."""
        with self._lock:
            if not self._core.request_close():
                return
        self._loop.stop()

    # ------------------------------------------------------------------ Services: model

    @property
    def handshake(self) -> Handshake:
        return self._core.handshake

    @property
    def model(self) -> ModelInfo:
        return self._core.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._core.tokenizer

    # ------------------------------------------------------------------ Services: contexts

    def create_context(self, run_id: int, context_id: int = 0) -> int:
        """A new context (with id `context_id` if given: replicas choose ids unique across them)."""
        with self._lock:
            return self._core.create_context(run_id, context_id)

    def fork_context(self, run_id: int, context_id: int, child_id: int = 0) -> int:
        with self._lock:
            child = self._core.fork_context(run_id, context_id, child_id)
        self._loop.wake()  # the partial page's copy
        return child

    def set_run_group(self, run_id: int, group: str) -> None:
        """Count `run_id` with the other runs of `group` (an API key) against the group's share
        of the pages; call before the run's first pass."""
        with self._lock:
            self._core.contexts.set_group(run_id, group)

    def context_length(self, run_id: int, context_id: int) -> int:
        with self._lock:
            self._core.contexts.check_owner(run_id, context_id)
            return self._core.pages.length(context_id)

    def context_num_pages(self, run_id: int, context_id: int) -> int:
        with self._lock:
            self._core.contexts.check_owner(run_id, context_id)
            return len(self._core.pages.held(context_id))

    def truncate_context(self, run_id: int, context_id: int, length: int) -> None:
        with self._lock:
            self._core.truncate_context(run_id, context_id, length)

    def release_context(self, run_id: int, context_id: int) -> None:
        with self._lock:
            self._core.release_context(run_id, context_id)

    def release_slots(self, run_id: int, context_id: int, start: int, stop: int) -> int:
        with self._lock:
            return self._core.release_slots(run_id, context_id, start, stop)

    def end_run(self, run_id: int) -> None:
        with self._lock:
            self._core.end_run(run_id)

    # ------------------------------------------------------------------ Services: passes

    def forward(
        self, run_id: int, context_id: int, request: PassRequest, may_wait: Callable[[], None] | None = None
    ) -> PassResult:
        future: concurrent.futures.Future[PassResult] = concurrent.futures.Future()
        with self._lock:
            served = self._core.submit(run_id, context_id, request, future)
        self._loop.wake()
        return served if served is not None else result_in_slices(future, may_wait)

    def forward_group(
        self, run_id: int, passes: Sequence[tuple[int, PassRequest]], may_wait: Callable[[], None] | None = None
    ) -> list[PassResult | HostError]:
        """Every pass queued before the loop is woken, so it schedules them together."""
        pending: list[PassResult | HostError | concurrent.futures.Future[PassResult]] = []
        for start in range(0, len(passes), GROUP_SLICE):
            if start:
                # Between slices the lock is let go and the interpreter handed on, so the loop
                # (routing a reply) and other runs' passes wait for one slice, not the group
                # (1,000 checks and stagings held the lock ~100 ms).
                time.sleep(0)
            with self._lock:
                for context_id, request in passes[start : start + GROUP_SLICE]:
                    future: concurrent.futures.Future[PassResult] = concurrent.futures.Future()
                    try:
                        served = self._core.submit(run_id, context_id, request, future)
                    except HostError as exc:
                        pending.append(exc)
                        continue
                    pending.append(served if served is not None else future)
        self._loop.wake()
        results: list[PassResult | HostError] = []
        for item in pending:
            if isinstance(item, concurrent.futures.Future):
                try:
                    item = result_in_slices(item, may_wait)
                except HostError as exc:
                    item = exc
            results.append(item)
        return results

    def generate(self, run_id: int, context_id: int, first: PassRequest, next_step: NextStep) -> None:
        chain = Chain(self._core, self._lock, run_id, context_id, next_step)
        chain.start(first)
        self._loop.wake()
        chain.finished.result()

    def max_decode_steps(self) -> int:
        return self._core.max_decode_steps()

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this driver's tokenizer, built on first use (importing
        xgrammar and building the token table take a second or two)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                say = self.config.progress
                started = time.monotonic()
                if say is not None:
                    say("loading the grammar engines for the first grammar (once per process, a few seconds)")
                try:
                    from host.grammar import GrammarCompiler, TokenizerSpec
                except ImportError as exc:  # installed without the `grammar` extra
                    raise FeatureUnavailable(
                        f"grammar-constrained decoding needs the grammar extra (pip install 'wafer[grammar]'): {exc}"
                    ) from None
                budget = self.config.grammar_budget
                self._grammar_compiler = GrammarCompiler(
                    TokenizerSpec.from_handshake(self._core.handshake),
                    compile_budget_s=budget.compile_s,
                    max_grammar_mib=budget.max_grammar_mib,
                    cache_mib=budget.cache_mib,
                )
                if say is not None:
                    say(f"grammar engines ready in {time.monotonic() - started:.1f} s")
            return self._grammar_compiler

    def load_adapter(self, run_id: int, name: str) -> int:
        """Adapters stay loaded on the driver once loaded (a cache shared by runs, at most
        `max_loaded_adapters`: the least recently used one no run holds is unloaded for a new
        one); `end_run` drops the run's right to use them. `name` is resolved inside the
        adapter directory only (`host.engine.adapters`)."""
        try:
            path = resolve(self.config.adapter_dir, name)
        except AdapterNameError as exc:
            raise InvalidRequest(str(exc)) from None
        with self._adapter_lock:
            adapter_id = self._adapters.lookup(name)
            if adapter_id is None:
                with self._lock:
                    in_use = self._core.adapters_in_use()
                try:
                    adapter_id, victim = self._adapters.plan_load(in_use)
                except AdapterSlotsFull as exc:
                    raise InvalidRequest(str(exc)) from None
                if victim is not None:
                    unload = Adapter(op="unload", adapter_id=victim)
                    self._loop.call(lambda link: link.request(unload, Ack), f"unloading adapter {victim}")
                    self._adapters.unloaded(victim)
                message = Adapter(op="load", adapter_id=adapter_id, path=path)
                self._loop.call(lambda link: link.request(message, Ack), f"loading adapter {name!r}")
                self._adapters.loaded(name, adapter_id)
            with self._lock:  # inside the adapter lock: a victim is chosen only among unheld ones
                self._core.grant_adapter(run_id, adapter_id)
        return adapter_id

    @property
    def num_loaded_adapters(self) -> int:
        with self._adapter_lock:
            return len(self._adapters)

    # ------------------------------------------------------------------ statistics

    def speculation_stats(self) -> dict[str, int]:
        """Hits, staged passes, misses and skips by reason (for benches and /metrics)."""
        with self._lock:
            return self._core.speculation_stats()

    def timing_stats(self) -> dict[str, float]:
        """Cumulative seconds of host work by stage, and passes sent (for benchmarks)."""
        return self._loop.timing_stats()

    def prefix_stats(self) -> dict[str, int]:
        """Prefix-cache hits, tokens reused, evictions and cached pages (empty when off)."""
        with self._lock:
            return self._core.contexts.prefix.stats()

    def driver_health(self) -> dict[str, int | float | str]:
        reply = self._loop.call(lambda link: link.request(Health(), HealthReply), "health check")
        return dict(reply.stats)

    # ------------------------------------------------------------------ inspection (tests, daemon)

    @property
    def num_free_pages(self) -> int:
        with self._lock:
            return self._core.pages.num_free

    @property
    def num_pages(self) -> int:
        return self._core.pages.num_pages

    @property
    def num_available_pages(self) -> int:
        """Free pages and cached ones no context holds (a new pass can take either)."""
        with self._lock:
            return self._core.pages.num_available

    def run_usage(self, run_id: int) -> tuple[int, int]:
        """(contexts, distinct KV pages) the run holds now (for tests and the harness)."""
        with self._lock:
            return self._core.contexts.usage(run_id)

    def run_num_tokens(self, run_id: int) -> int:
        """Tokens in the run's contexts now, each context counted whole (the daemon's console)."""
        with self._lock:
            return sum(self._core.pages.length(c) for c in self._core.contexts.of_run(run_id))

    def context_pages(self, context_id: int) -> tuple[int, ...]:
        with self._lock:
            return self._core.pages.pages(context_id)

    def page_refcount(self, page: int) -> int:
        with self._lock:
            return self._core.pages.refcount(page)
