"""The engine core: every piece of engine state, built in one constructor from the
configuration and the driver's handshake, changed only through a few verbs.

Thread-free and clock-free, like the cores it composes (host.engine.pages, host.engine.scheduler,
host.engine.prefix): the thread-facing `Engine` facade and the loop (host.engine.loop) call it with
the engine's lock held. Its verbs:

- the context verbs (`create_context`, `fork_context`, `truncate_context`, `release_context`,
  `release_slots`, `end_run`), on `host.engine.contexts.Contexts`, the lifecycle owner;
- `submit` (= `check_pass` + `queue`): check a pass and queue it; every result or error goes to
  the waiter it was queued with, handed over once the lock is released (`take_handovers`);
- `next_batch` / `complete` / `fail` / `isolate`: the loop's side, one driver pass at a time;
- `break_link` / `shut_down`: the link is gone, or the loop ends.

Pass-level speculation is not in here: host.engine.speculation is a layer around `submit` and
`next_batch`, which queues its pre-fired passes through `enqueue` and hears of their results
through their waiters, like any other client of the core.
"""

from __future__ import annotations

import itertools

from bridge_schema.batch import OutputResult
from bridge_schema.messages import MULTI_STEP, Handshake
from host.engine.config import EngineConfig
from host.engine.contexts import Contexts
from host.engine.pages import PageCopy, PageTable
from host.engine.pass_check import check_holes_masked, check_request
from host.engine.passes import Handover, Outcome, Pass, Waiter, resolve
from host.engine.prefix import NoPrefixReuse, PrefixReuse
from host.engine.prefix_cache import PrefixCache
from host.engine.scheduler import Batch, PassLimits, Scheduler
from host.engine.staging import NO_STATS
from host.errors import DriverFailed, EngineClosed, HostError, InvalidRequest, RunEnded
from host.services import ModelInfo, PassRequest, PassResult, Tokenizer
from host.tokenizer import tokenizer_from_handshake

# Two passes in flight: the driver works on one while the next is built and sent.
MAX_PASSES_IN_FLIGHT = 2


class EngineCore:
    def __init__(self, config: EngineConfig, handshake: Handshake) -> None:
        h = handshake
        if h.page_size <= 0 or h.num_pages <= 0 or h.vocab_size <= 0:
            raise DriverFailed(f"driver handshake has no usable page pool or vocabulary: {h}")
        config.check_resolved(h.page_size)
        self.handshake = h
        self.tokenizer: Tokenizer = tokenizer_from_handshake(h)
        quota = config.page_quota(h.num_pages)
        self.model = ModelInfo(
            name=h.model_name,
            vocab_size=h.vocab_size,
            page_size=h.page_size,
            max_context=h.max_context,
            stop_token_ids=tuple(int(t) for t in h.stop_token_ids),
            control_token_ids=tuple(int(t) for t in h.control_token_ids),
            # A longer prompt is refused up front by the OpenAI API, not failed mid-run.
            run_max_tokens=quota.run_pages * h.page_size,
            max_probe_k=h.max_probe_k,
        )
        cache = PrefixCache() if config.prefix_match_unit else None
        pages = PageTable(h.num_pages, h.page_size, cache)
        limits = PassLimits(
            max_requests_per_pass=h.max_requests_per_pass,
            max_tokens_per_pass=h.max_tokens_per_pass,
            max_mask_bytes=h.max_mask_bytes,
            vocab_size=h.vocab_size,
            max_fill_chunk_tokens=config.max_fill_chunk_tokens or h.max_fill_chunk_tokens,
        )
        self._scheduler = Scheduler(limits, h.page_size)
        self._tickets = itertools.count(1)
        prefix = PrefixReuse(pages, cache) if cache is not None else NoPrefixReuse()
        self.contexts = Contexts(pages, prefix, self._scheduler, quota, config.max_run_contexts)
        self.pages = pages
        self._waiters: dict[int, Waiter] = {}  # ticket -> who gets the pass's result
        self._handovers: list[Handover] = []  # outcomes for waiters, once the lock is released
        self._run_adapters: dict[int, set[int]] = {}
        self._decode_steps_cap = config.decode_steps_cap
        self._multi_step_budget_s = config.multi_step_budget_ms / 1000
        self.is_multi_step = MULTI_STEP in h.capabilities and cache is None and self._decode_steps_cap > 1
        self._step_s = 0.0  # moving average of a pass's time per decode step, send to reply
        self.num_in_flight = 0
        self.broken: HostError | None = None  # set once the link is gone: every call fails with it
        self.is_close_requested = False
        self.is_closing = False

    # ------------------------------------------------------------------ state

    def check_usable(self) -> None:
        if self.is_close_requested:
            raise EngineClosed()
        if self.broken is not None:
            raise self.broken
        if self.is_closing:
            raise EngineClosed()

    @property
    def is_stopping(self) -> bool:
        return self.is_closing or self.broken is not None

    def request_close(self) -> bool:
        """False if a close was requested already."""
        if self.is_close_requested:
            return False
        self.is_close_requested = self.is_closing = True
        return True

    # ------------------------------------------------------------------ contexts

    def create_context(self, run_id: int, context_id: int = 0) -> int:
        self.check_usable()
        return self.contexts.create(run_id, context_id)

    def fork_context(self, run_id: int, context_id: int, child_id: int = 0) -> int:
        self.check_usable()
        return self.contexts.fork(run_id, context_id, child_id)

    def truncate_context(self, run_id: int, context_id: int, length: int) -> None:
        self.contexts.check_owner(run_id, context_id)
        self.contexts.invalidate(context_id)  # a staged pass on it would count as pending
        self.contexts.check_idle(context_id, "truncate")
        self.contexts.truncate(context_id, length)

    def release_slots(self, run_id: int, context_id: int, start: int, stop: int) -> int:
        self.contexts.check_owner(run_id, context_id)
        return self.contexts.release_slots(context_id, start, stop)

    def release_context(self, run_id: int, context_id: int) -> None:
        self.contexts.check_owner(run_id, context_id)
        self._drop_context(context_id, RunEnded(f"context {context_id} was released while its pass waited"))

    def end_run(self, run_id: int) -> None:
        for context_id in self.contexts.of_run(run_id):
            self._drop_context(context_id, RunEnded(f"run {run_id} ended while its pass waited"))
        self._run_adapters.pop(run_id, None)
        self.contexts.forget_run(run_id)

    def drop_unused_steps(self, context_id: int, count: int) -> None:
        """A generation stopped inside a multi-step pass: its last `count` slots leave the
        context (nothing of the context is pending or staged after such a pass)."""
        self.contexts.truncate(context_id, self.pages.length(context_id) - count)

    def _drop_context(self, context_id: int, reason: HostError) -> None:
        for item in self.contexts.cancel_pending(context_id):
            self._fail_item(item, reason)
        self.contexts.release(context_id)

    # ------------------------------------------------------------------ adapters

    def adapters_in_use(self) -> set[int]:
        return set().union(*self._run_adapters.values())

    def grant_adapter(self, run_id: int, adapter_id: int) -> None:
        self._run_adapters.setdefault(run_id, set()).add(adapter_id)

    # ------------------------------------------------------------------ passes

    def submit(self, run_id: int, context_id: int, request: PassRequest, waiter: Waiter) -> PassResult | None:
        """Queue one pass; `waiter` gets its result (or the error) when it comes. Returns None
        here; a layer that can answer at once (host.engine.speculation) returns the result."""
        self.queue(self.check_pass(run_id, context_id, request), waiter)
        return None

    def check_pass(self, run_id: int, context_id: int, request: PassRequest) -> Pass:
        """The request, checked against the context and the driver, as a pass not yet queued."""
        self.check_usable()
        self.contexts.check_owner(run_id, context_id)
        pages = self.pages
        item = check_request(request, pages.length(context_id), self.handshake, self._run_adapters.get(run_id, set()))
        if pages.has_holes(context_id):
            check_holes_masked(item, pages.pages(context_id), pages.page_size)
        if not self.is_multi_step:
            item.steps = 1
        item.run_id, item.context_id = run_id, context_id
        return item

    def queue(self, item: Pass, waiter: Waiter) -> Pass:
        """Queue a checked pass: prefix reuse may trim it, its slots are reserved (all now, or it
        fails at once). Returns the pass as queued."""
        run_id, context_id, pages, prefix = item.run_id, item.context_id, self.pages, self.contexts.prefix
        kv_start = pages.length(context_id)
        prefix.record(context_id, item.tokens, item.positions, item.adapter_id, item.mask_rows is not None)
        reused, item = prefix.reuse(context_id, item)
        if item.steps > 1:  # as many steps as there are slots for, down to one
            item.steps = max(1, min(item.steps, pages.free_slots(context_id)))
        self.contexts.extend(run_id, context_id, len(item.tokens) + item.steps - 1)
        item.pages, item.kv_start = pages.pages(context_id), kv_start + reused
        self.enqueue(item, waiter)
        return item

    def enqueue(self, item: Pass, waiter: Waiter) -> None:
        """Give `item` (its run, context, pages and KV start set) a ticket and queue it."""
        item.ticket = next(self._tickets)
        self._waiters[item.ticket] = waiter
        self._scheduler.submit(item)

    def cancel(self, tickets: set[int]) -> None:
        """Drop these passes, waiting or in flight, without telling their waiters."""
        for item in self._scheduler.cancel(lambda p: p.ticket in tickets):
            self._waiters.pop(item.ticket, None)

    def speculation_stats(self) -> dict[str, int]:
        return dict(NO_STATS)

    def max_decode_steps(self) -> int:
        """Steps per multi-step request: as many as fit in `multi_step_budget_ms` of the device
        at the measured time per step, so a multi-step pass never holds up other requests or a
        client's stream by much more than that; 1 until a pass has been timed."""
        if not self.is_multi_step or not self._step_s:
            return 1
        return max(1, min(self._decode_steps_cap, int(self._multi_step_budget_s / self._step_s)))

    # ------------------------------------------------------------------ the loop's verbs

    def take_copies(self) -> list[PageCopy]:
        """Page copies to send before the next pass (the driver handles frames in order)."""
        return self.contexts.take_copies()

    def next_batch(self) -> Batch | None:
        """The next driver pass, or None (nothing waits, or two are in flight already)."""
        if self.num_in_flight >= MAX_PASSES_IN_FLIGHT:
            return None
        batch = self._scheduler.next_batch()
        if batch is None:
            if self.num_in_flight == 0:
                self._fail_unschedulable()
            return None
        self.num_in_flight += 1
        return batch

    def complete(self, batch: Batch, outputs: list[list[OutputResult]], elapsed_s: float) -> None:
        """A pass's results came back after `elapsed_s` at the driver: route them."""
        self.num_in_flight -= 1
        steps = max(chunk.item.steps for chunk in batch.chunks)
        sample = elapsed_s / steps
        self._step_s = sample if not self._step_s else 0.8 * self._step_s + 0.2 * sample
        for item in self._scheduler.complete(batch, outputs):
            self._on_finished(item)

    def hand_over(self, waiter: Waiter, outcome: Outcome) -> None:
        """Give `waiter` its result or error: a staging relay (`under_lock`) at once, any other
        once the lock is released (`take_handovers`), so its code never runs under it."""
        if getattr(waiter, "under_lock", False):
            resolve([(waiter, outcome)])
        else:
            self._handovers.append((waiter, outcome))

    def take_handovers(self) -> list[Handover]:
        """The outcomes collected since the last call, for whoever releases the lock to give
        out (`host.engine.passes.resolve`) once it has."""
        handovers, self._handovers = self._handovers, []
        return handovers

    def isolate(self, batch: Batch) -> None:
        """The driver refused `batch`: which request is bad is unknown, so each goes again alone
        and only that one fails."""
        self.num_in_flight -= 1
        self._scheduler.isolate(batch)

    def fail(self, batch: Batch, error: HostError) -> HostError:
        """`batch` failed with `error`; returns the error its passes got."""
        if self.is_close_requested:  # the link went down because the engine is closing
            error = EngineClosed("the engine closed while the pass waited")
        self.num_in_flight -= 1
        for item in self._scheduler.fail(batch):
            self._fail_item(item, error)
        return error

    def mark_broken(self, error: HostError) -> None:
        """Nothing the driver does from now on can be trusted: every later call fails."""
        self.broken = self.broken or error

    def break_link(self, error: HostError) -> None:
        """Every waiting pass fails now; later calls fail with the same error."""
        self.mark_broken(error)
        for item in self._scheduler.cancel(lambda p: True):
            self._fail_item(item, error)

    def shut_down(self) -> None:
        """The loop ended: every waiter left fails."""
        self.is_closing = True
        error = self.broken or EngineClosed("the engine closed while the pass waited")
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            self.hand_over(waiter, error)

    # ------------------------------------------------------------------ internals

    def _on_finished(self, item: Pass) -> None:
        self.contexts.prefix.register_completed(item.context_id, item.kv_start + len(item.tokens))
        waiter = self._waiters.pop(item.ticket, None)
        if waiter is not None:
            self.hand_over(waiter, PassResult(outputs=item.results))

    def _fail_unschedulable(self) -> None:
        """Nothing in flight and nothing fits: fail what waits rather than let it wait forever
        (request checks make this unreachable; this is the guard against a hang)."""
        if self._scheduler.has_work():
            for item in self._scheduler.cancel(lambda p: True):
                self._fail_item(item, InvalidRequest("the pass does not fit the driver's per-pass limits"))

    def _fail_item(self, item: Pass, error: HostError) -> None:
        """Fail the waiter and give back the slots the pass had reserved."""
        waiter = self._waiters.pop(item.ticket, None)
        if waiter is not None:
            self.hand_over(waiter, error)
        end = item.kv_start + len(item.tokens)
        if self.pages.has(item.context_id) and self.pages.length(item.context_id) == end:
            self.contexts.truncate(item.context_id, item.kv_start)
