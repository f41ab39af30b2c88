"""Continuous batching: folds every run's pending forward passes into driver passes.

Pure: no sockets, threads or clock. It knows the driver's limits and each pass's pages, never
the page table, the bridge transport or the runs. Large fills go out in chunks (chunked prefill),
chunks of one context in order; a context with a chunk in flight waits until it returns. Runs
take turns: a pass is filled one request per run at a time, so a run with thousands of contexts
queued takes the room the others leave, not their places.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import zip_longest

from bridge_schema.batch import OutputResult, OutputSpec, RequestSpec, logit_mask_words
from host.engine.attention_masks import drop_unattended_pages
from host.engine.pages import HOLE, pages_for
from host.engine.passes import Pass

_UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class PassLimits:
    """Driver limits (from the handshake; 0 = unlimited) and the scheduler's own knobs.

    A pass whose remaining tokens are at most `short_pass_tokens` (a decode step, a short verify)
    is admitted before fills. While a fill waits, short passes leave it at least one request slot
    and `fill_reserve_tokens` tokens, so neither kind starves the other.
    """

    max_requests_per_pass: int
    max_tokens_per_pass: int
    max_mask_bytes: int = 0
    vocab_size: int = 0
    max_fill_chunk_tokens: int = 0  # 0 = as large as the pass allows
    short_pass_tokens: int = 8
    fill_reserve_tokens: int = 256

    def requests(self) -> int:
        return self.max_requests_per_pass or _UNLIMITED

    def tokens(self) -> int:
        return self.max_tokens_per_pass or _UNLIMITED

    def mask_words(self) -> int:
        return self.max_mask_bytes // 4 if self.max_mask_bytes else _UNLIMITED


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens [start, stop) of a pending pass, as one request of a driver pass."""

    item: Pass
    start: int
    stop: int
    spec: RequestSpec

    @property
    def is_last(self) -> bool:
        return self.stop == len(self.item.tokens)


@dataclass(frozen=True, slots=True)
class Batch:
    batch_id: int
    chunks: tuple[Chunk, ...]

    def specs(self) -> list[RequestSpec]:
        return [c.spec for c in self.chunks]

    @property
    def num_tokens(self) -> int:
        return sum(c.stop - c.start for c in self.chunks)


def trim_runs(runs: Sequence[int], num_keys: int) -> list[int]:
    """A BRLE row (false run first) cut to its first `num_keys` keys."""
    out: list[int] = []
    total = 0
    for run in runs:
        take = min(int(run), num_keys - total)
        out.append(take)
        total += take
        if total == num_keys:
            break
    return out


class Scheduler:
    def __init__(self, limits: PassLimits, page_size: int) -> None:
        self.limits = limits
        self.page_size = page_size
        self._queue: dict[int, Pass] = {}  # by ticket; insertion order is arrival order
        self._in_flight: dict[int, Batch] = {}
        self._busy_contexts: Counter[int] = Counter()  # context -> chunks in flight
        self._queued_contexts: Counter[int] = Counter()  # context -> its passes in the queue
        self._next_batch_id = 1

    # ------------------------------------------------------------------ queue

    def submit(self, item: Pass) -> None:
        assert item.ticket not in self._queue, "tickets are unique"
        self._queue[item.ticket] = item
        self._queued_contexts[item.context_id] += 1

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def has_pending(self, context_id: int) -> bool:
        """True while a pass of this context waits or is in flight."""
        return self._queued_contexts[context_id] > 0

    def has_work(self) -> bool:
        """True when `next_batch` would return a batch."""
        return any(item.context_id not in self._busy_contexts for item in self._queue.values())

    def cancel(self, predicate: Callable[[Pass], bool]) -> list[Pass]:
        """Drop every matching pass, waiting or in flight; a chunk in flight still returns but
        its results are discarded. Returns the dropped passes (to fail their waiters)."""
        dropped = [item for item in self._queue.values() if predicate(item)]
        for item in dropped:
            item.is_cancelled = True
            self._dequeue(item)
        return dropped

    # ------------------------------------------------------------------ batching

    def next_batch(self) -> Batch | None:
        """The next pass to send, or None when nothing is ready. Contexts in the returned batch
        are busy until `complete` or `fail` is called with it."""
        heads: list[Pass] = []
        seen: set[int] = set()
        for item in self._queue.values():
            if item.context_id in seen or item.is_sent:
                continue
            seen.add(item.context_id)
            # A busy context's next pass waits for the reply, unless it is deferred: the driver
            # runs passes in order and fills its first token in from the one in flight.
            if item.context_id not in self._busy_contexts or item.deferred:
                heads.append(item)
        if not heads:
            return None
        heads = _runs_in_turn(heads)
        # While a pass is in flight, the next goes only to follow a deferred (pre-fired) step
        # (or to retry a refused batch one request at a time):
        # the driver runs passes in order, so sending early gains only the host's build and
        # send time, and waiting lets the steps that the pass in flight gives back join this
        # one. Sent at once, they split into two half batches that alternate for good (measured:
        # 8 grammar-constrained SmolLM2 runs made 2 passes a step and decoded at 0.55-0.7x).
        if self._in_flight and not any(i.deferred or i.is_isolated for i in heads):
            return None
        isolated = next((i for i in heads if i.is_isolated), None)
        if isolated is not None:
            taken = self._take(isolated, _Budget(1, self.limits.tokens(), self.limits.mask_words()), True)
            assert taken is not None, "a checked pass always fits an empty pass"
            return self._launch([taken[0]])
        lim = self.limits
        short = [i for i in heads if i.num_remaining <= lim.short_pass_tokens]
        fills = [i for i in heads if i.num_remaining > lim.short_pass_tokens]
        budget = _Budget(lim.requests(), lim.tokens(), lim.mask_words())
        chunks: list[Chunk] = []
        if fills:
            # Short passes leave room for the oldest fill so it always advances.
            reserve = min(lim.fill_reserve_tokens, fills[0].num_remaining, budget.tokens // 2)
            short_budget = _Budget(budget.requests - 1, budget.tokens - reserve, budget.mask_words)
        else:
            short_budget = budget
        admitted: set[int] = set()
        for item in short:
            taken = self._take(item, short_budget, allow_partial=False)
            if taken is not None:
                budget.spend(*taken)
                if short_budget is not budget:
                    short_budget.spend(*taken)
                chunks.append(taken[0])
                admitted.add(item.ticket)
        for item in heads:
            if budget.requests <= 0 or budget.tokens <= 0:
                break
            if item.ticket in admitted:
                continue
            taken = self._take(item, budget, allow_partial=True)
            if taken is not None:
                budget.spend(*taken)
                chunks.append(taken[0])
        if not chunks:
            return None
        return self._launch(chunks)

    def _launch(self, chunks: list[Chunk]) -> Batch:
        batch = Batch(self._next_batch_id, tuple(sorted(chunks, key=lambda c: c.item.ticket)))
        self._next_batch_id += 1
        self._in_flight[batch.batch_id] = batch
        self._busy_contexts.update(c.item.context_id for c in batch.chunks)
        for chunk in batch.chunks:
            chunk.item.is_sent = chunk.is_last
        return batch

    def complete(self, batch: Batch, outputs: Sequence[Sequence[OutputResult]]) -> list[Pass]:
        """Record a returned batch (`outputs` per chunk, in batch order). Returns the passes
        that are now finished, their `results` filled, in ticket order."""
        assert len(outputs) == len(batch.chunks), "one output list per chunk"
        self._retire(batch)
        finished: list[Pass] = []
        for chunk, results in zip(batch.chunks, outputs, strict=True):
            item = chunk.item
            if item.is_cancelled:
                continue
            item.results.extend(results)
            item.num_done = chunk.stop
            item.is_isolated = False
            if chunk.is_last:
                self._dequeue(item)
                finished.append(item)
        return finished

    def isolate(self, batch: Batch) -> None:
        """The driver refused `batch` as a whole: its chunks go back to the queue, each to be
        retried in a pass of its own, so one bad request fails alone and the others still run."""
        self._retire(batch)
        for chunk in batch.chunks:
            chunk.item.is_isolated = True
            chunk.item.is_sent = False

    def fail(self, batch: Batch) -> list[Pass]:
        """A batch that did not return: each of its passes is dropped (also their later chunks).
        Returns those passes, to fail their waiters."""
        self._retire(batch)
        failed: list[Pass] = []
        for chunk in batch.chunks:
            item = chunk.item
            if item.is_cancelled:
                continue
            item.is_cancelled = True
            if item.ticket in self._queue:
                self._dequeue(item)
            failed.append(item)
        return failed

    # ------------------------------------------------------------------ internals

    def _dequeue(self, item: Pass) -> None:
        del self._queue[item.ticket]
        self._queued_contexts[item.context_id] -= 1
        if not self._queued_contexts[item.context_id]:
            del self._queued_contexts[item.context_id]

    def _retire(self, batch: Batch) -> None:
        assert self._in_flight.pop(batch.batch_id, None) is batch, f"batch {batch.batch_id} is not in flight"
        self._busy_contexts.subtract(c.item.context_id for c in batch.chunks)
        self._busy_contexts += Counter()  # drops the contexts with nothing left in flight

    def _logit_words(self, chunk: Chunk) -> int:
        if not self.limits.vocab_size:
            return 0
        num_masks = sum(o.logit_mask is not None for o in chunk.spec.outputs)
        return num_masks * logit_mask_words(self.limits.vocab_size)

    def _take(self, item: Pass, budget: _Budget, allow_partial: bool) -> tuple[Chunk, int] | None:
        """The largest next chunk of `item` that fits `budget`, with its mask words, or None."""
        if budget.requests <= 0:
            return None
        start = item.num_done
        size = min(item.num_remaining, budget.tokens)
        if self.limits.max_fill_chunk_tokens and item.num_remaining > self.limits.short_pass_tokens:
            size = min(size, self.limits.max_fill_chunk_tokens)
        while size > 0:
            if not allow_partial and size < item.num_remaining:
                return None
            chunk = self._chunk(item, start, start + size)
            rows = chunk.spec.mask_rows or ()
            words = sum(len(row) for row in rows) + self._logit_words(chunk)
            if words <= budget.mask_words:
                return chunk, words
            # Masks too big for what is left: halve the chunk (rows carry the mask bytes).
            size //= 2
        return None

    def _chunk(self, item: Pass, start: int, stop: int) -> Chunk:
        # A multi-step request (one token, never split) also holds the slots of its later steps.
        kv_len = item.kv_start + stop + item.steps - 1
        num_pages = pages_for(kv_len, self.page_size)
        mask_rows = None
        if item.mask_rows is not None:
            mask_rows = [trim_runs(item.mask_rows[i], kv_len) for i in range(start, stop)]
        if start == 0 and stop == len(item.tokens):  # the whole pass (a decode step): rows as they are
            outputs = list(item.outputs)
        else:
            outputs = [
                OutputSpec(o.row - start, o.sampler, o.probe, o.probe_k, o.logit_mask, o.score_token)
                for o in item.outputs
                if start <= o.row < stop
            ]
        if item.steps > 1:  # its one output samples every step, on rows 0 .. steps-1
            outputs = [replace(outputs[0], row=j) for j in range(item.steps)]
        pages: Sequence[int] = item.pages[:num_pages]
        last_page_len = kv_len - (num_pages - 1) * self.page_size
        if mask_rows is not None:  # pages no row attends to stay out of the pass
            pages, last_page_len, mask_rows = drop_unattended_pages(
                pages, last_page_len, stop - start, mask_rows, self.page_size
            )
        assert HOLE not in pages, "a released page reached a pass (its mask was checked on entry)"
        spec = RequestSpec(
            context_id=item.context_id,
            tokens=item.tokens[start:stop],
            positions=item.positions[start:stop],
            pages=pages,
            last_page_len=last_page_len,
            outputs=outputs,
            adapter_id=item.adapter_id,
            mask_rows=mask_rows,
            deferred=item.deferred and start == 0,
            steps=item.steps,
        )
        return Chunk(item, start, stop, spec)


def _runs_in_turn(heads: list[Pass]) -> list[Pass]:
    """`heads` (in arrival order) reordered so that runs take turns: each run's oldest, then each
    run's second oldest, and so on, runs in the order of their oldest pass."""
    by_run: dict[int, list[Pass]] = {}
    for item in heads:
        by_run.setdefault(item.run_id, []).append(item)
    if len(by_run) < 2:
        return heads
    return [item for turn in zip_longest(*by_run.values()) for item in turn if item is not None]


@dataclass(slots=True)
class _Budget:
    requests: int
    tokens: int
    mask_words: int

    def spend(self, chunk: Chunk, words: int) -> None:
        self.requests -= 1
        self.tokens -= chunk.stop - chunk.start
        self.mask_words -= words
