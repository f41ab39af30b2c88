"""The engine: implements `host.services.Services` over the page table, the scheduler and one
driver link. Run threads call it (blocking); an anyio event loop on a background thread (its
half in host.pass_loop) owns the bridge client, builds passes and routes results back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from bridge_schema.config_rules import check_prefix_match_unit
from bridge_schema.errors import BridgeError, ConfigError, RemoteError
from bridge_schema.messages import (
    DEFERRED_TOKENS,
    MAX_DECODE_STEPS,
    MULTI_STEP,
    Ack,
    Adapter,
    Handshake,
    Health,
    HealthReply,
    Hello,
)
from host.adapters import AdapterNameError, AdapterSlotsFull, AdapterTable, resolve
from host.driver_link import DriverLink, DriverSpec
from host.errors import (
    ContextNotFound,
    ContextNotOwned,
    DriverFailed,
    EngineClosed,
    HostError,
    InvalidRequest,
    RunEnded,
)
from host.page_quota import PageQuota
from host.pages import PageCopy, PageTable
from host.pass_check import check_holes_masked, check_request
from host.pass_loop import PassLoop
from host.prefix import PrefixReuse
from host.prefix_cache import PrefixCache
from host.scheduler import Batch, PassLimits, PendingPass, Scheduler
from host.services import ModelInfo, NextStep, PassRequest, PassResult, Tokenizer
from host.speculator import RequestShape
from host.staging import Staging, Waiter, shape_of
from host.tokenizer import tokenizer_from_handshake
from host.waiting import result_in_slices

if TYPE_CHECKING:
    from host.grammar import GrammarCompiler

log = logging.getLogger(__name__)
T = TypeVar("T")
# A multi-step pass should hold the device about this long at most (see `max_decode_steps`).
MULTI_STEP_BUDGET_S = 0.010


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """The grammar compiler's budgets (host.grammar.GrammarCompiler): seconds a compile is waited
    for (0: no limit), MiB one compiled grammar may take, MiB the compiled-grammar cache keeps."""

    compile_s: float = 10.0
    max_grammar_mib: float = 64.0
    cache_mib: float = 512.0


class Engine:
    """Use `Engine.start(...)`; `close()` (or a `with` block) stops the loop and the driver."""

    def __init__(
        self,
        spec: DriverSpec,
        adapter_dir: str = "",
        max_fill_chunk_tokens: int = 0,
        max_decode_steps: int = 16,
        max_loaded_adapters: int = 64,
        max_run_page_fraction: float = 1.0,
        max_group_page_fraction: float = 1.0,
        grammar_budget: GrammarBudget | None = None,
    ) -> None:
        self._spec = spec
        self._grammar_budget = grammar_budget or GrammarBudget()
        self._max_decode_steps = max(1, min(max_decode_steps, MAX_DECODE_STEPS))
        self._is_multi_step = False  # set from the handshake
        self._step_s = 0.0  # moving average of a pass's time per decode step, send to reply
        self._speculation_depth = spec.hello.speculation_depth
        self._adapter_dir = adapter_dir
        self._max_fill_chunk_tokens = max_fill_chunk_tokens
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._broken: HostError | None = None  # set once the link is gone: every call fails with it
        self._is_closing = False
        self._is_close_requested = False
        self._context_ids = itertools.count(1)
        self._tickets = itertools.count(1)
        self._owner: dict[int, int] = {}  # context -> run
        self._futures: dict[int, Waiter] = {}  # ticket -> waiter
        self._ready_chains: list[tuple[_Chain, PassResult]] = []  # generations to continue
        self._pending_copies: list[PageCopy] = []
        self._adapters = AdapterTable(max_loaded_adapters)  # loaded on the driver, shared by runs
        # The pool's size comes with the handshake.
        self._quota = PageQuota(0, max_run_page_fraction, max_group_page_fraction)
        self._run_adapters: dict[int, set[int]] = {}
        self._adapter_lock = threading.Lock()
        self._grammar_lock = threading.Lock()
        self._grammar_compiler: GrammarCompiler | None = None
        self._num_in_flight = 0
        self._schedule_s = 0.0  # building passes: scheduler + CSR packing (loop thread)
        self._complete_s = 0.0  # routing results back to runs (loop thread)
        self._num_passes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._link: DriverLink | None = None
        self._thread = threading.Thread(target=PassLoop(self).thread_main, name="wafer-engine", daemon=True)

    @classmethod
    def start(
        cls,
        driver: str = "dummy",
        driver_args: Sequence[str] = (),
        *,
        driver_module: str = "",
        page_size: int = 0,
        num_pages: int = 0,
        prefix_match_unit: int = 0,
        speculation_depth: int = 0,
        adapter_dir: str = "",
        max_loaded_adapters: int = 64,
        max_run_page_fraction: float = 1.0,
        max_group_page_fraction: float = 1.0,
        max_fill_chunk_tokens: int = 0,
        max_decode_steps: int = 16,
        startup_timeout_s: float = 60.0,
        grammar_budget: GrammarBudget | None = None,
    ) -> Engine:
        """Start (or connect to) the driver and wait for its handshake. `driver`: "dummy" or
        "torch" (a subprocess on a Unix socket), "loopback" (in-process), "unix:PATH" or
        "tcp:HOST:PORT". `page_size`/`num_pages` 0 take the driver's defaults. `adapter_dir`:
        where adapter names are resolved (on the driver's machine; "" turns adapters off).
        `max_run_page_fraction`: the most of the page pool one run's contexts may hold;
        `max_group_page_fraction`: the most the runs of one group (`set_run_group`) may hold.
        `max_decode_steps`: the most steps of a multi-step request (host-side generation runs
        that many per pass while passes are short; 1 turns multi-step off).
        `grammar_budget`: the grammar compiler's time and memory budgets."""
        hello = Hello(
            page_size=page_size,
            num_pages=num_pages,
            prefix_match_unit=prefix_match_unit,
            speculation_depth=speculation_depth,
        )
        if page_size:  # the configuration boundary: judged now against the size asked for, and
            # again after the handshake against the size the driver resolved
            try:
                check_prefix_match_unit(prefix_match_unit, page_size, speculation_depth)
            except ConfigError as exc:
                raise InvalidRequest(f"configuration rejected: {exc}") from None
        spec = DriverSpec(driver, tuple(driver_args), driver_module, startup_timeout_s, hello)
        spec.kind  # noqa: B018 - validates the driver name before a thread starts
        engine = cls(
            spec,
            adapter_dir,
            max_fill_chunk_tokens,
            max_decode_steps,
            max_loaded_adapters,
            max_run_page_fraction,
            max_group_page_fraction,
            grammar_budget,
        )
        engine._thread.start()
        engine._ready.wait()
        if engine._startup_error is not None:
            engine._thread.join()
            error = engine._startup_error
            raise error if isinstance(error, HostError) else DriverFailed(f"driver start failed: {error}")
        return engine

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Fail waiting passes with `EngineClosed`, shut the driver down, stop the loop."""
        with self._lock:
            if self._is_close_requested:
                return
            self._is_close_requested = self._is_closing = True
        self._wake_loop()
        self._thread.join()

    # ------------------------------------------------------------------ Services: model

    @property
    def handshake(self) -> Handshake:
        return self._handshake

    @property
    def model(self) -> ModelInfo:
        return self._model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    # ------------------------------------------------------------------ Services: contexts

    def create_context(self, run_id: int) -> int:
        with self._lock:
            self._check_usable()
            context_id = next(self._context_ids)
            self._pages.create(context_id)
            if self._prefix is not None:
                self._prefix.on_create(context_id)
            self._owner[context_id] = run_id
            return context_id

    def fork_context(self, run_id: int, context_id: int) -> int:
        with self._lock:
            self._check_usable()
            self._check_owner(run_id, context_id)
            self._staging.invalidate(context_id)
            self._check_idle(run_id, context_id, "fork")
            # A fork shares its parent's pages; it is charged them all (its own from the first
            # write on), and the copy of the partial page.
            self._check_page_quota(run_id, context_id, 0, extra_pages=len(self._pages.held(context_id)) + 1)
            child = next(self._context_ids)
            # The partial page's Copy goes out before the next pass (the loop sends copies first).
            self._pending_copies += self._pages.fork(context_id, child)
            if self._prefix is not None:
                self._prefix.on_fork(context_id, child)
            self._owner[child] = run_id
        self._wake_loop()
        return child

    def _check_page_quota(self, run_id: int, context_id: int, num_tokens: int, extra_pages: int = 0) -> None:
        """PageQuotaExceeded if growing `context_id` by `num_tokens` (and `extra_pages`) would
        take its run's contexts past their share of the pool (lock held). Pages shared by
        contexts count once per context: a quota errs on the side of the others."""
        if self._quota.is_unlimited:
            return
        ps = self._pages.page_size
        now = len(self._pages.pages(context_id))
        needed = max(0, -(-(self._pages.length(context_id) + num_tokens) // ps) - now) + extra_pages
        if needed == 0:
            return
        held: dict[int, int] = {}
        for c, r in self._owner.items():
            held[r] = held.get(r, 0) + len(self._pages.held(c))
        self._quota.check(run_id, needed, held)

    def set_run_group(self, run_id: int, group: str) -> None:
        """Count `run_id` with the other runs of `group` (an API key) against the group's share
        of the pages; call before the run's first pass."""
        with self._lock:
            self._quota.set_group(run_id, group)

    def context_length(self, run_id: int, context_id: int) -> int:
        with self._lock:
            self._check_owner(run_id, context_id)
            return self._pages.length(context_id)

    def context_num_pages(self, run_id: int, context_id: int) -> int:
        with self._lock:
            self._check_owner(run_id, context_id)
            return len(self._pages.held(context_id))

    def truncate_context(self, run_id: int, context_id: int, length: int) -> None:
        with self._lock:
            self._check_owner(run_id, context_id)
            self._staging.invalidate(context_id)
            self._check_idle(run_id, context_id, "truncate")
            self._truncate(context_id, length)

    def release_context(self, run_id: int, context_id: int) -> None:
        with self._lock:
            self._check_owner(run_id, context_id)
            self._drop_context(context_id, RunEnded(f"context {context_id} was released while its pass waited"))

    def release_slots(self, run_id: int, context_id: int, start: int, stop: int) -> int:
        with self._lock:
            self._check_owner(run_id, context_id)
            self._staging.invalidate(context_id)
            self._check_idle(run_id, context_id, "release pages of")
            released = self._pages.release_pages(context_id, start, stop)
            if released and self._prefix is not None:
                self._prefix.on_release_pages(context_id)
            return released

    def end_run(self, run_id: int) -> None:
        with self._lock:
            for context_id in [c for c, r in self._owner.items() if r == run_id]:
                self._drop_context(context_id, RunEnded(f"run {run_id} ended while its pass waited"))
            self._run_adapters.pop(run_id, None)
            self._quota.forget(run_id)

    # ------------------------------------------------------------------ Services: passes

    def forward(
        self, run_id: int, context_id: int, request: PassRequest, may_wait: Callable[[], None] | None = None
    ) -> PassResult:
        future: concurrent.futures.Future[PassResult] = concurrent.futures.Future()
        with self._lock:
            served = self._submit(run_id, context_id, request, future)
        self._wake_loop()
        return served if served is not None else result_in_slices(future, may_wait)

    def generate(self, run_id: int, context_id: int, first: PassRequest, next_step: NextStep) -> None:
        chain = _Chain(self, run_id, context_id, next_step)
        with self._lock:
            served = self._submit(run_id, context_id, first, chain)
            if served is not None:
                chain.continue_from(served)
        self._wake_loop()
        chain.finished.result()

    def max_decode_steps(self) -> int:
        """Steps per multi-step request: as many as fit in `MULTI_STEP_BUDGET_S` of the device
        at the measured time per step, so a multi-step pass never holds up other requests or a
        client's stream by much more than that; 1 until a pass has been timed."""
        if not self._is_multi_step or not self._step_s:
            return 1
        return max(1, min(self._max_decode_steps, int(MULTI_STEP_BUDGET_S / self._step_s)))

    def _note_pass_time(self, batch: Batch, elapsed_s: float) -> None:
        """A pass took `elapsed_s` at the driver, from its start to its reply (loop thread)."""
        steps = max(chunk.item.steps for chunk in batch.chunks)
        sample = elapsed_s / steps
        self._step_s = sample if not self._step_s else 0.8 * self._step_s + 0.2 * sample

    def _submit(self, run_id: int, context_id: int, request: PassRequest, waiter: Waiter) -> PassResult | None:
        """Queue one pass (lock held). Returns its result when a staged pass that already
        returned serves it; else `waiter` gets the result (or the error) when it comes."""
        self._check_usable()
        self._check_owner(run_id, context_id)
        kv_start = self._pages.length(context_id)
        checked = check_request(request, kv_start, self._handshake, self._run_adapters.get(run_id, set()))
        if self._pages.has_holes(context_id):
            check_holes_masked(checked, self._pages.pages(context_id), self._pages.page_size)
        steps = checked.steps if self._is_multi_step else 1
        shape = shape_of(
            checked.tokens,
            checked.positions,
            checked.outputs,
            request.adapter_id,
            checked.mask_rows is not None,
            request.has_grammar,
            steps,
        )
        staged = self._staging.take(context_id, shape)
        if staged is not None:
            # Served by a pre-fired pass: its slot, held already, becomes part of the context.
            copies = self._pages.extend(context_id, 1)
            assert not copies, "a staged slot needed a page copy"
            if self._prefix is not None:
                self._prefix.record(context_id, list(shape.tokens), [shape.position], request.adapter_id, False)
            if staged.result is None:
                staged.waiter = waiter
            self._staging.after_served(staged)  # with deferred tokens, the next step goes now
            return staged.result
        if self._prefix is not None:
            self._prefix.record(
                context_id,
                checked.tokens.tolist(),
                checked.positions.tolist(),
                request.adapter_id,
                checked.mask_rows is not None,
            )
            reused, checked = self._prefix.reuse(context_id, checked, request.adapter_id)
            kv_start += reused
        if steps > 1:  # as many steps as there are slots for, down to one
            steps = max(1, min(steps, self._pages.free_slots(context_id)))
        # Reserved now, so a pass either gets all its pages or fails at once (OutOfPages).
        self._check_page_quota(run_id, context_id, len(checked.tokens) + steps - 1)
        self._pending_copies += self._pages.extend(context_id, len(checked.tokens) + steps - 1)
        item = PendingPass(
            ticket=next(self._tickets),
            run_id=run_id,
            context_id=context_id,
            tokens=checked.tokens,
            positions=checked.positions,
            pages=self._pages.pages(context_id),
            kv_start=kv_start,
            outputs=checked.outputs,
            adapter_id=request.adapter_id,
            mask_rows=checked.mask_rows,
            has_grammar=request.has_grammar,
            steps=steps,
        )
        self._futures[item.ticket] = waiter
        self._enqueue(item)
        return None

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this driver's tokenizer, built on first use (importing
        xgrammar and building the token table take a second or two)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from host.grammar import GrammarCompiler, TokenizerSpec

                spec = TokenizerSpec.from_handshake(self._handshake)
                budget = self._grammar_budget
                self._grammar_compiler = GrammarCompiler(
                    spec,
                    compile_budget_s=budget.compile_s,
                    max_grammar_mib=budget.max_grammar_mib,
                    cache_mib=budget.cache_mib,
                )
            return self._grammar_compiler

    def speculation_stats(self) -> dict[str, int]:
        """Hits, staged passes, misses and skips by reason (for benches and /metrics)."""
        with self._lock:
            return self._staging.stats()

    def timing_stats(self) -> dict[str, float]:
        """Cumulative seconds of host work by stage, and passes sent (for benchmarks)."""
        client = self._link.client if self._link is not None else None
        return {
            "passes": float(self._num_passes),
            "schedule_s": self._schedule_s,
            "complete_s": self._complete_s,
            "encode_s": client.encode_s if client is not None else 0.0,
            "decode_s": client.decode_s if client is not None else 0.0,
        }

    def prefix_stats(self) -> dict[str, int]:
        """Prefix-cache hits, tokens reused, evictions and cached pages (empty when off)."""
        with self._lock:
            return self._prefix.stats() if self._prefix is not None else {}

    def load_adapter(self, run_id: int, name: str) -> int:
        """Adapters stay loaded on the driver once loaded (a cache shared by runs, at most
        `max_loaded_adapters`: the least recently used one no run holds is unloaded for a new
        one); `end_run` drops the run's right to use them. `name` is resolved inside the
        adapter directory only (`host.adapters`)."""
        try:
            path = resolve(self._adapter_dir, name)
        except AdapterNameError as exc:
            raise InvalidRequest(str(exc)) from None
        with self._adapter_lock:
            adapter_id = self._adapters.lookup(name)
            if adapter_id is None:
                with self._lock:
                    in_use = set().union(*self._run_adapters.values())
                try:
                    adapter_id, victim = self._adapters.plan_load(in_use)
                except AdapterSlotsFull as exc:
                    raise InvalidRequest(str(exc)) from None
                if victim is not None:
                    unload = Adapter(op="unload", adapter_id=victim)
                    self._call_in_loop(lambda link: link.request(unload, Ack), f"unloading adapter {victim}")
                    self._adapters.unloaded(victim)
                message = Adapter(op="load", adapter_id=adapter_id, path=path)
                self._call_in_loop(lambda link: link.request(message, Ack), f"loading adapter {name!r}")
                self._adapters.loaded(name, adapter_id)
            with self._lock:  # inside the adapter lock: a victim is chosen only among unheld ones
                self._run_adapters.setdefault(run_id, set()).add(adapter_id)
        return adapter_id

    @property
    def num_loaded_adapters(self) -> int:
        with self._adapter_lock:
            return len(self._adapters)

    # ------------------------------------------------------------------ inspection (tests, daemon)

    @property
    def num_free_pages(self) -> int:
        with self._lock:
            return self._pages.num_free

    @property
    def num_pages(self) -> int:
        return self._pages.num_pages

    @property
    def num_available_pages(self) -> int:
        """Free pages and cached ones no context holds (a new pass can take either)."""
        with self._lock:
            return self._pages.num_available

    def run_usage(self, run_id: int) -> tuple[int, int]:
        """(contexts, distinct KV pages) the run holds now (for tests and the harness)."""
        with self._lock:
            contexts = [c for c, r in self._owner.items() if r == run_id]
            return len(contexts), len({p for c in contexts for p in self._pages.held(c)})

    def context_pages(self, context_id: int) -> tuple[int, ...]:
        with self._lock:
            return self._pages.pages(context_id)

    def page_refcount(self, page: int) -> int:
        with self._lock:
            return self._pages.refcount(page)

    def driver_health(self) -> dict[str, int | float | str]:
        reply = self._call_in_loop(lambda link: link.request(Health(), HealthReply), "health check")
        return dict(reply.stats)

    # ------------------------------------------------------------------ the speculator's seam

    def _enqueue(self, item: PendingPass) -> None:
        """Where a cold pass enters batching (lock held); `forward` has already offered the
        request to the staged chain (`host.staging`)."""
        self._scheduler.submit(item)

    def _on_dispatched(self, batch: Batch) -> None:
        """A pass is about to be sent (lock held): with deferred tokens, each decode step in it
        that finishes its request has its next step staged now, to follow it at the driver."""
        if not self._staging.is_enabled:
            return
        for chunk in batch.chunks:
            if chunk.is_last and not chunk.item.is_cancelled:
                self._staging.on_dispatched(chunk.item, self._decode_shape(chunk.item))

    def _decode_shape(self, item: PendingPass) -> RequestShape | None:
        """The speculation features of a cold pass that samples, else None."""
        if not item.outputs or not self._pages.has(item.context_id):
            return None
        return shape_of(
            item.tokens,
            item.positions,
            item.outputs,
            item.adapter_id,
            item.mask_rows is not None,
            item.has_grammar,
            item.steps,
        )

    def _on_finished(self, finished: list[PendingPass]) -> None:
        """Passes whose results just came back (lock held): staged ones go to `host.staging`;
        cold ones to their waiters, and each plain decode's next step is pre-fired (or, staged
        already while it was in flight, gets its input token)."""
        for item in finished:
            if self._prefix is not None:
                self._prefix.register_completed(item.context_id, item.kv_start + len(item.tokens))
            if self._staging.on_finished(item):
                continue
            future = self._futures.pop(item.ticket, None)
            if future is not None:
                future.set_result(PassResult(outputs=item.results))
            if self._staging.is_enabled and item.results and not self._staging.on_cold_finished(item):
                shape = self._decode_shape(item)  # staged when it returns, not when it was sent
                if shape is not None:
                    self._staging.stage_after(item.run_id, item.context_id, shape, item.results[-1].token)
        # Generations continue only now, with every result of this pass routed: their next steps
        # may take the passes just staged.
        ready, self._ready_chains = self._ready_chains, []
        for chain, result in ready:
            chain.continue_from(result)

    # ------------------------------------------------------------------ run-thread helpers

    def _check_usable(self) -> None:
        if self._is_close_requested:
            raise EngineClosed()
        if self._broken is not None:
            raise self._broken
        if self._is_closing:
            raise EngineClosed()

    def _check_owner(self, run_id: int, context_id: int) -> None:
        owner = self._owner.get(context_id)
        if owner is None:
            raise ContextNotFound(context_id)
        if owner != run_id:
            raise ContextNotOwned(context_id, run_id)

    def _check_idle(self, run_id: int, context_id: int, what: str) -> None:
        """Fork and truncate need the context's KV settled: its pending pass's pages would
        otherwise be copied before they are written, or freed under it."""
        self._check_owner(run_id, context_id)
        if self._scheduler.has_pending(context_id):
            raise InvalidRequest(f"cannot {what} context {context_id} while a forward pass on it is pending")

    def _drop_context(self, context_id: int, reason: HostError) -> None:
        self._staging.invalidate(context_id)
        for item in self._scheduler.cancel(lambda p: p.context_id == context_id):
            self._fail_item(item, reason)
        self._pages.release(context_id)
        if self._prefix is not None:
            self._prefix.on_release(context_id)
        del self._owner[context_id]

    def _drop_unused_steps(self, context_id: int, count: int) -> None:
        """A generation stopped inside a multi-step pass: its last `count` slots leave the
        context (lock held; nothing of the context is pending or staged after such a pass)."""
        self._staging.invalidate(context_id)
        self._truncate(context_id, self._pages.length(context_id) - count)

    def _truncate(self, context_id: int, length: int) -> None:
        """The context keeps its first `length` slots (lock held)."""
        self._pages.truncate(context_id, length)
        if self._prefix is not None:
            self._prefix.on_truncate(context_id, length)

    def _fail_item(self, item: PendingPass, error: HostError) -> None:
        """Fail the waiter and give back the slots the pass had reserved (lock held)."""
        if not self._staging.on_failed(item, error):
            self._staging.on_cold_failed(item)
            future = self._futures.pop(item.ticket, None)
            if future is not None:
                future.set_exception(error)
        end = item.kv_start + len(item.tokens)
        if self._pages.has(item.context_id) and self._pages.length(item.context_id) == end:
            self._truncate(item.context_id, item.kv_start)

    def _wake_loop(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # the loop already stopped; close() and the loop's exit fail every waiter

    def _wake_here(self) -> None:
        """`_wake_loop` from the loop thread itself: no self-pipe write needed."""
        assert self._wake is not None
        self._wake.set()

    def _call_in_loop(self, make: Callable[[DriverLink], Coroutine[Any, Any, T]], what: str) -> T:
        """Run a bridge request on the loop from a run thread and wait for its reply."""
        with self._lock:
            self._check_usable()
        assert self._loop is not None and self._link is not None
        try:
            return asyncio.run_coroutine_threadsafe(make(self._link), self._loop).result()
        except RemoteError as exc:
            raise DriverFailed(f"{what} failed: {exc}", exc.status, exc.code) from None
        except (BridgeError, concurrent.futures.CancelledError) as exc:
            raise DriverFailed(f"{what} failed: the driver link is gone ({exc})") from None

    # ------------------------------------------------------------------ the driver's handshake

    def _on_handshake(self, h: Handshake) -> None:
        if h.page_size <= 0 or h.num_pages <= 0 or h.vocab_size <= 0:
            raise DriverFailed(f"driver handshake has no usable page pool or vocabulary: {h}")
        try:  # the same rule the driver ran on Hello, now against the page size it resolved
            hello = self._spec.hello
            check_prefix_match_unit(hello.prefix_match_unit, h.page_size, hello.speculation_depth)
        except ConfigError as exc:
            raise InvalidRequest(f"configuration rejected after the handshake: {exc}") from None
        self._handshake = h
        self._tokenizer: Tokenizer = tokenizer_from_handshake(h)
        self._model = ModelInfo(
            name=h.model_name,
            vocab_size=h.vocab_size,
            page_size=h.page_size,
            max_context=h.max_context,
            stop_token_ids=tuple(int(t) for t in h.stop_token_ids),
            control_token_ids=tuple(int(t) for t in h.control_token_ids),
        )
        unit = self._spec.hello.prefix_match_unit
        if unit and unit != h.page_size:
            raise InvalidRequest(
                f"prefix_match_unit {unit} is sub-page: prefix reuse matches whole pages of the "
                f"driver's resolved page size {h.page_size}"
            )
        cache = PrefixCache() if unit else None
        self._pages = PageTable(h.num_pages, h.page_size, cache)
        self._quota.num_pages = h.num_pages
        self._prefix = PrefixReuse(self._pages, cache) if cache is not None else None
        limits = PassLimits(
            max_requests_per_pass=h.max_requests_per_pass,
            max_tokens_per_pass=h.max_tokens_per_pass,
            max_mask_bytes=h.max_mask_bytes,
            vocab_size=h.vocab_size,
            max_fill_chunk_tokens=self._max_fill_chunk_tokens,
        )
        self._scheduler = Scheduler(limits, h.page_size)
        self._is_multi_step = MULTI_STEP in h.capabilities and cache is None and self._max_decode_steps > 1
        self._staging = Staging(
            self._speculation_depth,
            self._pages,
            self._scheduler,
            lambda: next(self._tickets),
            deferred_tokens=DEFERRED_TOKENS in h.capabilities,
        )


class _Chain:
    """One `Engine.generate`: the waiter of each of its steps in turn. A step's result is
    turned into the next request on the engine's loop thread, as soon as the result is routed,
    so a host-side generation costs no thread hop per token."""

    def __init__(self, engine: Engine, run_id: int, context_id: int, next_step: NextStep) -> None:
        self._engine = engine
        self._run_id = run_id
        self._context_id = context_id
        self._next_step = next_step
        self.finished: concurrent.futures.Future[None] = concurrent.futures.Future()

    def set_result(self, result: PassResult) -> None:
        self._engine._ready_chains.append((self, result))  # continued at the end of _on_finished

    def set_exception(self, exception: BaseException) -> None:
        if not self.finished.done():
            self.finished.set_exception(exception)

    def done(self) -> bool:
        return self.finished.done()

    def continue_from(self, result: PassResult) -> None:
        """Submit the steps that follow `result` (lock held) until one has to wait for the
        driver, or the caller's rule says stop."""
        try:
            while True:
                used, request = self._next_step(result)
                if used < len(result.outputs):
                    self._engine._drop_unused_steps(self._context_id, len(result.outputs) - used)
                if request is None:
                    break
                served = self._engine._submit(self._run_id, self._context_id, request, self)
                if served is None:
                    return
                result = served
        except BaseException as exc:  # HostError from a refused step, or the rule's own failure
            self.set_exception(exc)
            return
        self.finished.set_result(None)
