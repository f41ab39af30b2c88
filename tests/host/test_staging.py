"""host.engine.staging, driven step by step (no threads, no driver): the next
step is staged when the pass it follows is sent, its anchor filled in when that pass returns,
and a chain at depth 2 grows back from its last entry whenever a request takes its first."""

from __future__ import annotations

import itertools

import numpy as np

from bridge_schema.batch import OutputResult, OutputSpec, Sampler
from host.engine.pages import PageTable
from host.engine.passes import Outcome, Pass, Waiter, resolve
from host.engine.scheduler import Batch, PassLimits, Scheduler
from host.engine.staging import StagedPass, Staging
from host.services import PassResult

CTX, RUN, PAGE = 1, 1, 4
SAMPLER = Sampler.greedy()


class Harness:
    def __init__(self, depth: int) -> None:
        self.tickets = itertools.count(1)
        self.pages = PageTable(64, PAGE)
        self.scheduler = Scheduler(PassLimits(max_requests_per_pass=8, max_tokens_per_pass=64), PAGE)
        self.waiters: dict[int, Waiter] = {}
        self.staging = Staging(depth, self.pages, self)
        self.pages.create(CTX)
        self.pages.extend(CTX, 3)  # a prompt, already in the cache
        self.batches: list[Batch] = []

    # The staging's sink, as the engine core is.
    def enqueue(self, item: Pass, waiter: Waiter) -> None:
        item.ticket = next(self.tickets)
        self.waiters[item.ticket] = waiter
        self.scheduler.submit(item)

    def cancel(self, tickets: set[int]) -> None:
        for item in self.scheduler.cancel(lambda p: p.ticket in tickets):
            del self.waiters[item.ticket]

    def hand_over(self, waiter: Waiter, outcome: Outcome) -> None:
        resolve([(waiter, outcome)])

    def cold(self, token: int) -> Pass:
        """The inferlet's own decode request, cold, as the engine would queue it."""
        kv_start = self.pages.length(CTX)
        self.pages.extend(CTX, 1)
        item = Pass(
            run_id=RUN,
            context_id=CTX,
            tokens=np.array([token], np.uint32),
            positions=np.array([kv_start], np.uint32),
            pages=self.pages.pages(CTX),
            kv_start=kv_start,
            outputs=(OutputSpec(0, SAMPLER),),
        )
        cold = self.staging.watch(_Ignored())
        cold.item = item
        self.enqueue(item, cold)
        return item

    def dispatch(self) -> list[Pass]:
        """Build the next pass and tell staging it is being sent, as the loop thread does."""
        batch = self.scheduler.next_batch()
        assert batch is not None
        for chunk in batch.chunks:
            item = chunk.item
            self.staging.on_dispatched(item)
        self.batches.append(batch)
        return [c.item for c in batch.chunks]

    def finish_oldest(self, token: int) -> Pass:
        batch = self.batches.pop(0)
        (item,) = self.scheduler.complete(batch, [[OutputResult(token)]])
        self.waiters.pop(item.ticket).set_result(PassResult(outputs=item.results))
        return item

    def request(self, token: int, position: int) -> StagedPass | None:
        """The inferlet asks for a decode step: the staged pass that serves it, if any."""
        tokens, positions = np.array([token], np.uint32), np.array([position], np.uint32)
        return self.staging.take(CTX, Pass(tokens=tokens, positions=positions, outputs=(OutputSpec(0, SAMPLER),)).shape)

    def waiting(self) -> list[tuple[int, bool]]:
        """(position, deferred) of the passes queued and not yet sent."""
        queued = self.scheduler._queue.values()
        return [(int(i.positions[0]), i.deferred) for i in queued if not i.is_sent]


class _Ignored:
    """The inferlet's side of a cold pass: nothing to check there."""

    def set_result(self, result: PassResult) -> None:
        pass

    def set_exception(self, exception: BaseException) -> None:
        pass

    def done(self) -> bool:
        return False


def test_the_next_step_is_staged_when_its_pass_is_sent_and_resolved_when_it_returns() -> None:
    h = Harness(depth=1)
    h.cold(7)  # position 3
    assert h.waiting() == [(3, False)]
    h.dispatch()
    assert h.waiting() == [(4, True)]  # staged as the cold pass is sent, its token left to the driver
    assert h.request(42, 4) is None  # its anchor is unknown yet: it serves nothing (and is dropped)
    assert h.waiting() == []

    h = Harness(depth=1)
    h.cold(7)
    h.dispatch()
    h.finish_oldest(42)  # the cold pass sampled 42: the staged step's anchor is 42 now
    assert h.waiting() == [(4, True)]
    staged = h.request(42, 4)
    assert staged is not None and staged.entry.anchor == 42


def test_a_depth_2_chain_grows_back_from_its_last_entry_when_its_first_is_taken() -> None:
    h = Harness(depth=2)
    h.cold(7)  # position 3
    h.dispatch()  # sends it; stages S1 (position 4), deferred
    (s1,) = h.dispatch()  # sends S1; stages S2 (position 5) from it, deferred
    (s2,) = h.dispatch()
    assert s1.deferred and s2.deferred and [s1.positions[0], s2.positions[0]] == [4, 5]
    h.finish_oldest(42)  # the cold pass returns: S1's anchor is 42
    staged = h.request(42, 4)  # the inferlet asks for S1's step before S1 returned
    assert staged is not None
    h.staging.after_served(staged)
    # The chain is back to two: S3 (position 6) follows S2, which is in flight, deferred.
    assert h.waiting() == [(6, True)]
