"""The scheduler: limits, chunked prefill, in-flight contexts, fairness, failure and cancel."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge_schema.batch import OutputResult, OutputSpec, build_forward
from host.engine.pages import pages_for
from host.engine.passes import Pass
from host.engine.scheduler import Batch, PassLimits, Scheduler, trim_runs

PAGE = 4
_tickets = itertools.count(1)


def item(
    context_id: int,
    num_tokens: int,
    kv_start: int = 0,
    outputs: tuple[int, ...] | None = None,
    run_id: int = 1,
    mask: bool = False,
) -> Pass:
    kv_len = kv_start + num_tokens
    rows = (num_tokens - 1,) if outputs is None else outputs
    mask_rows = [[i, kv_len - i] for i in range(num_tokens)] if mask else None
    return Pass(
        ticket=next(_tickets),
        run_id=run_id,
        context_id=context_id,
        tokens=np.arange(num_tokens, dtype=np.uint32) % 250,
        positions=np.arange(kv_start, kv_len, dtype=np.uint32),
        pages=tuple(range(context_id * 1000, context_id * 1000 + pages_for(kv_len, PAGE))),
        kv_start=kv_start,
        outputs=tuple(OutputSpec(r) for r in rows),
        mask_rows=mask_rows,
    )


def results_for(batch: Batch) -> list[list[OutputResult]]:
    """Fake driver: each output's token is its absolute row in its pass."""
    return [[OutputResult(token=c.start + o.row) for o in c.spec.outputs] for c in batch.chunks]


def limits(max_requests: int = 8, max_tokens: int = 64, **kw: int) -> PassLimits:
    return PassLimits(max_requests_per_pass=max_requests, max_tokens_per_pass=max_tokens, **kw)


def test_decodes_of_many_contexts_share_one_pass() -> None:
    sched = Scheduler(limits(), PAGE)
    for cid in range(5):
        sched.submit(item(cid, 1, kv_start=6))
    batch = sched.next_batch()
    assert batch is not None and len(batch.chunks) == 5
    spec = batch.chunks[0].spec
    assert list(spec.pages) == [0, 1] and spec.last_page_len == 3  # kv_len 7 over pages of 4
    finished = sched.complete(batch, results_for(batch))
    assert [len(p.results) for p in finished] == [1] * 5
    assert sched.next_batch() is None


def test_request_limit_is_respected_and_oldest_go_first() -> None:
    sched = Scheduler(limits(max_requests=3), PAGE)
    items = [item(cid, 1) for cid in range(7)]
    for i in items:
        sched.submit(i)
    seen: list[int] = []
    while (batch := sched.next_batch()) is not None:
        assert len(batch.chunks) <= 3
        seen += [c.item.context_id for c in batch.chunks]
        sched.complete(batch, results_for(batch))
    assert seen == list(range(7))


def test_long_fill_is_chunked_in_order_and_only_its_last_chunk_samples() -> None:
    sched = Scheduler(limits(max_tokens=16), PAGE)
    fill = item(1, 40, kv_start=2)
    sched.submit(fill)
    spans = []
    while (batch := sched.next_batch()) is not None:
        (chunk,) = batch.chunks
        spans.append((chunk.start, chunk.stop, len(chunk.spec.outputs)))
        kv_len = (len(chunk.spec.pages) - 1) * PAGE + chunk.spec.last_page_len
        assert kv_len == 2 + chunk.stop
        assert list(chunk.spec.positions) == list(range(2 + chunk.start, 2 + chunk.stop))
        done = sched.complete(batch, results_for(batch))
    assert spans == [(0, 16, 0), (16, 32, 0), (32, 40, 1)]
    assert [r.token for r in done[0].results] == [39]


def test_output_rows_inside_early_chunks_are_kept_and_reindexed() -> None:
    sched = Scheduler(limits(max_tokens=10), PAGE)
    sched.submit(item(1, 25, outputs=(3, 12, 24)))
    finished = []
    while (batch := sched.next_batch()) is not None:
        finished += sched.complete(batch, results_for(batch))
    assert [r.token for r in finished[0].results] == [3, 12, 24]


def test_chunked_attention_masks_cover_exactly_each_chunks_keys() -> None:
    sched = Scheduler(limits(max_tokens=8), PAGE)
    sched.submit(item(1, 20, kv_start=3, mask=True))
    while (batch := sched.next_batch()) is not None:
        forward = build_forward(1, batch.specs())  # the real CSR packing
        spec = batch.chunks[0].spec
        # The chunk's keys: its pages (unattended ones may have been left out) and last page.
        kv_len = (len(spec.pages) - 1) * PAGE + spec.last_page_len
        assert kv_len <= 3 + batch.chunks[0].stop
        sums = np.add.reduceat(forward.mask_runs, forward.mask_row_indptr[:-1])
        assert (sums == kv_len).all()
        sched.complete(batch, results_for(batch))


def test_trim_runs() -> None:
    assert trim_runs([2, 3, 4], 4) == [2, 2]
    assert trim_runs([0, 9], 9) == [0, 9]
    assert trim_runs([2, 3], 2) == [2]


def test_a_pass_waits_while_one_is_in_flight_and_then_takes_what_it_gave_back() -> None:
    """Sent at once, steps of other contexts would split into two half batches that alternate
    for good; held, they join the steps the pass in flight gives back."""
    sched = Scheduler(limits(max_tokens=8), PAGE)
    sched.submit(item(1, 20))
    first = sched.next_batch()
    assert first is not None and sched.next_batch() is None  # chunk 2 waits for chunk 1
    sched.submit(item(2, 1))
    assert sched.next_batch() is None  # held while `first` is in flight
    sched.complete(first, results_for(first))
    second = sched.next_batch()
    assert second is not None
    assert sorted((c.item.context_id, c.start) for c in second.chunks) == [(1, 8), (2, 0)]


def test_a_deferred_step_goes_while_a_pass_is_in_flight_and_takes_the_waiting_along() -> None:
    sched = Scheduler(limits(max_tokens=8), PAGE)
    sched.submit(item(1, 1))
    first = sched.next_batch()
    assert first is not None
    sched.submit(item(2, 1))
    follower = item(1, 1, kv_start=1)
    follower.deferred = True
    sched.submit(follower)
    second = sched.next_batch()  # the pre-fired step goes now, and context 2 rides along
    assert second is not None and sorted(c.item.context_id for c in second.chunks) == [1, 2]


def test_decodes_are_not_starved_by_fills() -> None:
    sched = Scheduler(limits(max_requests=8, max_tokens=64, fill_reserve_tokens=32), PAGE)
    for cid in range(3):
        sched.submit(item(100 + cid, 500))  # older, long fills
    for cid in range(4):
        sched.submit(item(cid, 1))
    batch = sched.next_batch()
    assert batch is not None
    assert {c.item.context_id for c in batch.chunks} >= {0, 1, 2, 3}
    assert batch.num_tokens <= 64


def test_fills_are_not_starved_by_decodes() -> None:
    sched = Scheduler(limits(max_requests=4, max_tokens=64, fill_reserve_tokens=16), PAGE)
    fill = item(100, 50)
    sched.submit(fill)
    decoders = list(range(10))
    for cid in decoders:
        sched.submit(item(cid, 1))
    done = False
    for _ in range(20):
        batch = sched.next_batch()
        assert batch is not None
        assert len(batch.chunks) <= 4
        finished = sched.complete(batch, results_for(batch))
        done = done or fill in finished
        for p in finished:  # every decoder immediately asks for its next step
            if p.context_id != 100:
                sched.submit(item(p.context_id, 1))
    assert done


def test_fail_drops_the_whole_pass_and_cancel_drops_waiting_ones() -> None:
    sched = Scheduler(limits(max_tokens=8), PAGE)
    long, other = item(1, 20, run_id=1), item(2, 3, run_id=2)
    sched.submit(long)
    sched.submit(other)
    batch = sched.next_batch()
    assert batch is not None
    assert sched.fail(batch) == [long, other][: len(batch.chunks)]
    assert sched.num_waiting == 2 - len(batch.chunks)
    sched.submit(waiting := item(3, 1, run_id=7))
    assert sched.cancel(lambda p: p.run_id == 7) == [waiting]
    assert waiting.is_cancelled


def test_cancelled_pass_in_flight_is_not_reported_finished() -> None:
    sched = Scheduler(limits(), PAGE)
    sched.submit(p := item(1, 1, run_id=3))
    batch = sched.next_batch()
    assert batch is not None
    p.is_cancelled = True  # what Engine.end_run does for passes in flight
    assert sched.complete(batch, results_for(batch)) == []
    assert sched.num_in_flight == 0


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    max_requests=st.integers(1, 6),
    max_tokens=st.integers(1, 40),
    in_flight=st.integers(1, 3),
)
def test_every_pass_completes_within_limits_with_its_chunks_in_order(
    sizes: list[int], max_requests: int, max_tokens: int, in_flight: int
) -> None:
    sched = Scheduler(limits(max_requests=max_requests, max_tokens=max_tokens), PAGE)
    items = [item(cid, n, kv_start=cid % 5) for cid, n in enumerate(sizes)]
    for p in items:
        sched.submit(p)
    progress = {p.ticket: 0 for p in items}
    flying: list[Batch] = []
    finished: list[Pass] = []
    for _ in range(10_000):
        while len(flying) < in_flight and (batch := sched.next_batch()) is not None:
            assert len(batch.chunks) <= max_requests and batch.num_tokens <= max_tokens
            assert len({c.item.context_id for c in batch.chunks}) == len(batch.chunks)
            for c in batch.chunks:
                assert c.start == progress[c.item.ticket] and c.stop > c.start
                progress[c.item.ticket] = c.stop
            flying.append(batch)
        if not flying:
            break
        batch = flying.pop(0)
        finished += sched.complete(batch, results_for(batch))
    assert sorted(p.ticket for p in finished) == sorted(p.ticket for p in items)
    for p in finished:
        assert [r.token for r in p.results] == [len(p.tokens) - 1]


def test_a_refused_batch_is_retried_one_pass_per_request() -> None:
    sched = Scheduler(limits(), PAGE)
    good, bad = item(1, 1), item(2, 1)
    sched.submit(good)
    sched.submit(bad)
    batch = sched.next_batch()
    assert batch is not None and len(batch.chunks) == 2
    sched.isolate(batch)
    first = sched.next_batch()
    assert first is not None and [c.item for c in first.chunks] == [good]
    second = sched.next_batch()  # built while the first is in flight
    assert second is not None and [c.item for c in second.chunks] == [bad]
    assert sched.complete(first, results_for(first)) == [good]
    assert sched.fail(second) == [bad]
    assert sched.num_waiting == 0


def test_has_pending_covers_waiting_and_in_flight_passes() -> None:
    sched = Scheduler(limits(), PAGE)
    sched.submit(p := item(5, 1))
    assert sched.has_pending(5) and not sched.has_pending(6)
    batch = sched.next_batch()
    assert batch is not None and sched.has_pending(5)
    sched.complete(batch, results_for(batch))
    assert not sched.has_pending(5) and p.results


def test_a_deferred_step_follows_its_context_s_pass_in_flight_and_a_plain_one_waits() -> None:
    """A context's next pass waits for its pass in flight, unless its first token is deferred
    (the driver fills it in from the pass before, which it runs first): then it goes in the
    very next pass, never in the same one; the sent pass is not sent again."""
    sched = Scheduler(limits(), PAGE)
    source = item(1, 1, kv_start=5)
    sched.submit(source)
    first = sched.next_batch()
    assert first is not None and [c.item for c in first.chunks] == [source]
    plain = item(1, 1, kv_start=6)
    sched.submit(plain)
    assert sched.next_batch() is None  # context 1 is busy
    sched.cancel(lambda p: p is plain)
    follower = item(1, 1, kv_start=6)
    follower.deferred = True
    sched.submit(follower)
    second = sched.next_batch()
    assert second is not None and [c.item for c in second.chunks] == [follower]
    assert second.chunks[0].spec.deferred and not first.chunks[0].spec.deferred
    assert build_forward(0, second.specs()).deferred.tolist() == [0]
    assert sched.next_batch() is None  # both passes of context 1 are in flight
    assert [p.ticket for p in sched.complete(first, results_for(first))] == [source.ticket]
    assert sched.has_pending(1)  # the follower is still in flight
    assert [p.ticket for p in sched.complete(second, results_for(second))] == [follower.ticket]
    assert not sched.has_pending(1)


def test_runs_take_turns_so_a_run_with_thousands_of_contexts_does_not_push_others_back() -> None:
    """A run that queued 2,000 decodes first still leaves a place in the next pass for each other
    run (in arrival order they would wait 500 passes of 4)."""
    sched = Scheduler(limits(max_requests=4), PAGE)
    for cid in range(2000):
        sched.submit(item(cid, 1, run_id=1))
    sched.submit(item(5000, 1, run_id=2))
    sched.submit(item(6000, 30, run_id=3))  # a fill: it gets the room short passes leave it
    batch = sched.next_batch()
    assert batch is not None
    by_run = {c.item.run_id for c in batch.chunks}
    assert by_run == {1, 2, 3}, [c.item.context_id for c in batch.chunks]


def test_a_lone_run_still_fills_the_whole_pass() -> None:
    sched = Scheduler(limits(max_requests=4), PAGE)
    for cid in range(10):
        sched.submit(item(cid, 1, run_id=1))
    batch = sched.next_batch()
    assert batch is not None and [c.item.context_id for c in batch.chunks] == [0, 1, 2, 3]


def test_has_pending_follows_the_queue() -> None:
    sched = Scheduler(limits(), PAGE)
    first, second = item(1, 1), item(1, 1)
    sched.submit(first)
    sched.submit(second)
    batch = sched.next_batch()
    assert batch is not None and sched.has_pending(1)
    sched.complete(batch, results_for(batch))
    assert sched.has_pending(1)  # the second still waits
    sched.cancel(lambda p: p is second)
    assert not sched.has_pending(1)
    third = item(1, 1)
    sched.submit(third)
    batch = sched.next_batch()
    assert batch is not None
    sched.fail(batch)
    assert not sched.has_pending(1)
