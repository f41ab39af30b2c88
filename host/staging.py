"""The engine side of pass-level speculation: turns the speculator's staged entries into pending
passes, serves a matching inferlet request from one, and drops them when a chain is invalidated.

Every method is called with the engine's lock held. The decisions (what may be staged, what a
staged entry may serve) belong to `host.speculator`; this module only moves passes and results.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bridge_schema.batch import OutputSpec
from host.errors import HostError
from host.pages import PageTable
from host.scheduler import PendingPass, Scheduler
from host.services import PassResult
from host.speculator import RequestShape, Speculator, StagedEntry


def shape_of(
    tokens: npt.NDArray[np.uint32],
    positions: npt.NDArray[np.uint32],
    outputs: tuple[OutputSpec, ...],
    adapter_id: int,
    has_attention_mask: bool,
    has_grammar: bool = False,
) -> RequestShape:
    contiguous = len(positions) < 2 or bool((np.diff(positions.astype(np.int64)) == 1).all())
    return RequestShape(
        tokens=tuple(int(t) for t in tokens),
        position=int(positions[0]),
        outputs=outputs,
        adapter_id=adapter_id,
        has_grammar=has_grammar,
        has_attention_mask=has_attention_mask,
        explicit_positions_contiguous=contiguous,
    )


@dataclass(slots=True)
class StagedPass:
    entry: StagedEntry
    item: PendingPass
    result: PassResult | None = None
    waiter: concurrent.futures.Future[PassResult] | None = None  # set once a request took it
    served_shape: RequestShape | None = None


class Staging:
    def __init__(self, depth: int, pages: PageTable, scheduler: Scheduler, next_ticket: Callable[[], int]) -> None:
        self.speculator = Speculator(depth=depth)
        self._pages = pages
        self._scheduler = scheduler
        self._next_ticket = next_ticket
        self._by_ticket: dict[int, StagedPass] = {}
        self._chains: dict[int, list[StagedPass]] = {}  # context -> staged passes, chain order
        self.num_staged = 0

    @property
    def is_enabled(self) -> bool:
        return self.speculator.depth > 0

    # ------------------------------------------------------------------ producer

    def stage_after(self, run_id: int, context_id: int, shape: RequestShape, token: int) -> None:
        """After `shape` returned `token` on a context: pre-fire its next decode step."""
        entry = self.speculator.stage_after(context_id, shape, token)
        if entry is not None:
            self._submit(run_id, entry)

    def _submit(self, run_id: int, entry: StagedEntry) -> None:
        ctx = entry.context_id
        chain = self._chains.setdefault(ctx, [])
        offset = len(chain)  # slots past the committed length already taken by this chain
        if not self._pages.reserve(ctx, offset + 1):
            self.speculator.skips["no_free_slot"] += 1
            self._drop(ctx)
            return
        item = PendingPass(
            ticket=self._next_ticket(),
            run_id=run_id,
            context_id=ctx,
            tokens=np.array([entry.anchor], np.uint32),
            positions=np.array([entry.position], np.uint32),
            pages=self._pages.pages(ctx),
            kv_start=self._pages.length(ctx) + offset,
            outputs=(OutputSpec(0, entry.sampler),),  # an empty constraint surface, by construction
            adapter_id=entry.adapter_id,
        )
        staged = StagedPass(entry, item)
        chain.append(staged)
        self._by_ticket[item.ticket] = staged
        self._scheduler.submit(item)
        self.num_staged += 1

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

    def on_finished(self, item: PendingPass) -> bool:
        """Route a finished pass; True if it was a staged one (handled here)."""
        staged = self._by_ticket.pop(item.ticket, None)
        if staged is None:
            return False
        staged.result = PassResult(outputs=item.results)
        token = item.results[-1].token
        if staged.waiter is not None:
            staged.waiter.set_result(staged.result)
            self.after_served(staged)
        else:
            deeper = self.speculator.stage_from_entry(staged.entry, token)
            if deeper is not None:
                self._submit(item.run_id, deeper)
        return True

    def after_served(self, staged: StagedPass) -> None:
        """A request was answered from `staged`: stage the step after it."""
        assert staged.result is not None and staged.served_shape is not None
        self.stage_after(
            staged.item.run_id, staged.item.context_id, staged.served_shape, staged.result.outputs[-1].token
        )

    def on_failed(self, item: PendingPass, error: HostError) -> bool:
        """A staged pass failed or was cancelled; True if it was a staged one (handled here)."""
        staged = self._by_ticket.pop(item.ticket, None)
        if staged is None:
            return False
        if staged.waiter is not None and not staged.waiter.done():
            staged.waiter.set_exception(error)
        self._drop(item.context_id)
        return True

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
            self._scheduler.cancel(lambda p: p.ticket in tickets)

    def stats(self) -> dict[str, int]:
        s = self.speculator
        out = {"speculation_hits": s.hits, "speculation_staged": self.num_staged}
        out |= {f"speculation_miss_{k}": v for k, v in s.misses.items()}
        out |= {f"speculation_skip_{k}": v for k, v in s.skips.items()}
        return out
