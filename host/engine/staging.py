"""The engine side of pass-level speculation: turns the speculator's staged entries into pending
passes, serves a matching inferlet request from one, and drops them when a chain is invalidated.

It sits beside the engine core, not inside it (host.engine.speculation wires the two): staged
passes go into the core through `PassSink.enqueue` like any other, and their results come back
the way every pass's result does, through the waiter they were enqueued with (the `StagedPass`
itself). Every method is called with the engine's lock held. The decisions (what may be staged,
what a staged entry may serve) belong to `host.engine.speculator`; this module only moves passes
and results.

A context's next step is staged as soon as the pass it follows is sent (not when it returns),
with its input token left to the driver (the "deferred_tokens" capability, which `drivers.serve`
gives every driver): the next pass then waits at the driver while this one runs, and neither the
host's per-pass work nor the inferlet's round trip leaves the device idle. Its anchor is filled
in (`resolve`) when the pass it follows returns, before that pass's result reaches the inferlet;
until then it matches no request.

Results reach the requests' own waiters through `PassSink.hand_over`: after the engine's lock is
released, never from inside these relays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np

from bridge_schema.batch import OutputSpec
from host.engine.pages import PageTable
from host.engine.passes import Outcome, Pass, Waiter
from host.engine.speculator import RequestShape, Speculator, StagedEntry
from host.services import PassResult


class PassSink(Protocol):
    """Where staged passes go: the engine core's queue (host.engine.core)."""

    def enqueue(self, item: Pass, waiter: Waiter) -> None:
        """Queue `item` (its ticket set here); `waiter` gets its result or its error."""
        ...

    def cancel(self, tickets: set[int]) -> None:
        """Drop these passes, waiting or in flight, without telling their waiters."""
        ...

    def hand_over(self, waiter: Waiter, outcome: Outcome) -> None:
        """Give `waiter` its result or error once the engine's lock is released."""
        ...


# What `Staging.stats` reports with speculation off.
NO_STATS = {"speculation_hits": 0, "speculation_staged": 0}


@dataclass(slots=True, eq=False)
class StagedPass:
    """A pre-fired pass, and the waiter the core hands its result (or error) to."""

    under_lock: ClassVar[bool] = True  # a relay: the core calls it at once, under its lock
    entry: StagedEntry
    item: Pass
    staging: Staging = field(repr=False)
    result: PassResult | None = None
    waiter: Waiter | None = None  # set once a request took it
    served_shape: RequestShape | None = None
    is_dispatched: bool = False  # in a pass sent to the driver
    has_next: bool = False  # the context's next step was staged from this one

    def set_result(self, result: PassResult) -> None:
        self.staging.on_returned(self, result)

    def set_exception(self, exception: BaseException) -> None:
        self.staging.on_failed(self, exception)

    def done(self) -> bool:
        return self.result is not None


class Staging:
    def __init__(
        self,
        depth: int,
        pages: PageTable,
        sink: PassSink,
        may_reserve: Callable[[int, int, int], bool] | None = None,
    ) -> None:
        self.speculator = Speculator(depth=depth)
        self._pages = pages
        # (run, context, slots): whether the run's page quota lets the context take them
        self._may_reserve = may_reserve
        self._sink = sink
        self._by_ticket: dict[int, StagedPass] = {}
        self._chains: dict[int, list[StagedPass]] = {}  # context -> staged passes, chain order
        self._followers: dict[int, StagedPass] = {}  # ticket of a pass in flight -> the step staged after it
        self.num_staged = 0

    # ------------------------------------------------------------------ producer

    def on_dispatched(self, item: Pass) -> None:
        """`item`'s last chunk is in a pass being sent: stage the step after it now, after a
        staged pass or after a cold request that samples (its shape is taken only then: it
        copies the pass's tokens)."""
        staged = self._by_ticket.get(item.ticket)
        if staged is not None:
            staged.is_dispatched = True
            self._grow(staged)
        elif item.outputs and self._pages.has(item.context_id):
            entry = self.speculator.stage_after(item.context_id, item.shape, None)
            if entry is not None:
                follower = self._submit(item.run_id, entry)
                if follower is not None:
                    self._followers[item.ticket] = follower

    def watch(self, waiter: Waiter) -> ColdPass:
        """The waiter to queue a cold pass that samples with: `waiter` gets its result first,
        then the context's next step is staged after it (its `item` is set once queued)."""
        return ColdPass(waiter, self)

    def on_cold_returned(self, item: Pass, result: PassResult) -> None:
        """A cold pass returned: its next step was staged (or skipped) when it was sent; fill
        in that step's anchor."""
        follower = self._followers.pop(item.ticket, None)
        if follower is not None and result.outputs:
            self._resolve(follower, result.outputs[-1].token)

    def on_cold_failed(self, item: Pass) -> None:
        """A cold pass failed: the step staged after it can never be right."""
        follower = self._followers.pop(item.ticket, None)
        if follower is not None and follower.item.ticket in self._by_ticket:
            self._drop(item.context_id)

    def _grow(self, staged: StagedPass) -> None:
        """Stage the step after `staged` once it is sent (or its token is known): after the
        request it served if one took it, else deeper in its chain."""
        if staged.has_next:
            return
        token = staged.result.outputs[-1].token if staged.result is not None else None
        if token is None and not staged.is_dispatched:
            return
        if staged.served_shape is not None:
            entry = self.speculator.stage_after(staged.item.context_id, staged.served_shape, token)
        else:
            entry = self.speculator.stage_from_entry(staged.entry, token)
        if entry is None:
            return
        staged.has_next = True
        follower = self._submit(staged.item.run_id, entry)
        if follower is not None and token is None:
            self._followers[staged.item.ticket] = follower

    def _resolve(self, follower: StagedPass, token: int) -> None:
        if follower.item.ticket not in self._by_ticket:
            return  # dropped meanwhile
        resolved = self.speculator.resolve(follower.entry, token)
        if resolved is not None:
            follower.entry = resolved

    def _submit(self, run_id: int, entry: StagedEntry) -> StagedPass | None:
        ctx = entry.context_id
        chain = self._chains.setdefault(ctx, [])
        offset = len(chain)  # slots past the committed length already taken by this chain
        quota_ok = self._may_reserve is None or self._may_reserve(run_id, ctx, offset + 1)
        if not quota_ok or not self._pages.reserve(ctx, offset + 1):
            self.speculator.skips["no_free_slot"] += 1
            self._drop(ctx)
            return None
        deferred = entry.anchor is None
        item = Pass(
            tokens=np.array([0 if deferred else entry.anchor], np.uint32),
            positions=np.array([entry.position], np.uint32),
            outputs=(OutputSpec(0, entry.sampler),),  # an empty constraint surface, by construction
            adapter_id=entry.adapter_id,
            deferred=deferred,
            run_id=run_id,
            context_id=ctx,
            pages=self._pages.pages(ctx),
            kv_start=self._pages.length(ctx) + offset,
        )
        staged = StagedPass(entry, item, self)
        self._sink.enqueue(item, staged)
        chain.append(staged)
        self._by_ticket[item.ticket] = staged
        self.num_staged += 1
        return staged

    # ------------------------------------------------------------------ consumer

    def take(self, context_id: int, shape: RequestShape) -> StagedPass | None:
        """The staged pass that serves `shape`, or None; a mismatch drops the context's chain
        (its passes are cancelled) and the request goes the cold path."""
        chain = self._chains.get(context_id)
        if not chain:
            return None
        entry = self.speculator.take(context_id, shape)
        if entry is None:
            self._drop(context_id)
            return None
        staged = chain.pop(0)
        assert staged.entry == entry, "staging and speculator chains disagree"
        staged.served_shape = shape
        return staged

    # ------------------------------------------------------------------ results

    def on_returned(self, staged: StagedPass, result: PassResult) -> None:
        """A staged pass returned (the core hands it over as the pass's waiter)."""
        ticket = staged.item.ticket
        if self._by_ticket.pop(ticket, None) is None:
            return  # dropped meanwhile
        staged.result = result
        follower = self._followers.pop(ticket, None)
        if follower is not None and result.outputs:
            self._resolve(follower, result.outputs[-1].token)
        self._grow(staged)
        if staged.waiter is not None:
            self._sink.hand_over(staged.waiter, result)

    def after_served(self, staged: StagedPass) -> None:
        """A request was answered from `staged` (its result is known, or a waiter is set): stage
        the step after it, now if it is sent or its token known, else when that changes."""
        assert staged.served_shape is not None
        chain = self._chains.get(staged.item.context_id)
        # The chain shrank by one: grow it again from its last entry (or from `staged` if it
        # was the last).
        self._grow(chain[-1] if chain else staged)

    def on_failed(self, staged: StagedPass, error: BaseException) -> None:
        """A staged pass failed: the request that took it gets the error, and its chain goes."""
        ticket = staged.item.ticket
        if self._by_ticket.pop(ticket, None) is None:
            return  # dropped meanwhile
        self._followers.pop(ticket, None)
        if staged.waiter is not None:
            self._sink.hand_over(staged.waiter, error)
        self._drop(staged.item.context_id)

    def hand_over(self, waiter: Waiter, outcome: Outcome) -> None:
        self._sink.hand_over(waiter, outcome)

    # ------------------------------------------------------------------ invalidation

    def invalidate(self, context_id: int) -> None:
        """Truncate, fork, release, cancel and run end: the context's chain is discarded."""
        self._drop(context_id)

    def _drop(self, context_id: int) -> None:
        self.speculator.invalidate(context_id)
        chain = self._chains.pop(context_id, [])
        tickets = {s.item.ticket for s in chain}
        for ticket in tickets:
            self._by_ticket.pop(ticket, None)
        if tickets:
            self._sink.cancel(tickets)

    def stats(self) -> dict[str, int]:
        """Hits, staged passes, misses and skips by reason."""
        s = self.speculator
        out = {"speculation_hits": s.hits, "speculation_staged": self.num_staged}
        out |= {f"speculation_miss_{k}": v for k, v in s.misses.items()}
        out |= {f"speculation_skip_{k}": v for k, v in s.skips.items()}
        return out


class ColdPass:
    """The waiter of a cold pass that samples: its own waiter gets the result (or the error),
    then staging follows up on it (`Staging.watch`)."""

    __slots__ = ("item", "staging", "waiter")
    under_lock: ClassVar[bool] = True  # a relay: the core calls it at once, under its lock

    def __init__(self, waiter: Waiter, staging: Staging) -> None:
        self.waiter = waiter
        self.staging = staging
        self.item: Pass | None = None  # the pass as queued (after prefix reuse trimmed it)

    def set_result(self, result: PassResult) -> None:
        self.staging.hand_over(self.waiter, result)
        assert self.item is not None, "a cold pass returned before it was queued"
        self.staging.on_cold_returned(self.item, result)

    def set_exception(self, exception: BaseException) -> None:
        if self.item is not None:
            self.staging.on_cold_failed(self.item)
        self.staging.hand_over(self.waiter, exception)

    def done(self) -> bool:
        return self.waiter.done()
