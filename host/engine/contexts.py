"""Every context's lifecycle in one place: the run that owns it, its KV pages (host.engine.pages),
prefix reuse (host.engine.prefix; a null object when off), whoever must hear that its state changed
(speculation: the staged chain that assumed the old state goes, host.engine.speculation), and
the runs' shares of the page pool (host.engine.page_quota).

Pure, like the other cores: the engine core calls it with the engine's lock held.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from host.engine.page_quota import PageQuota
from host.engine.pages import PageCopy, PageTable
from host.engine.passes import Pass
from host.engine.prefix import NoPrefixReuse, PrefixReuse
from host.engine.scheduler import Scheduler
from host.errors import ContextLimitExceeded, ContextNotFound, ContextNotOwned, InvalidRequest, PageQuotaExceeded


class Contexts:
    def __init__(
        self,
        pages: PageTable,
        prefix: PrefixReuse | NoPrefixReuse,
        scheduler: Scheduler,
        quota: PageQuota,
        max_per_run: int = 0,
    ) -> None:
        """`max_per_run`: the most contexts one run may hold at once, forks included (0: no limit)."""
        self.pages = pages
        self.prefix = prefix
        self._listeners: list[Callable[[int], None]] = []  # told a context's state changed
        self._scheduler = scheduler
        self._quota = quota
        self._ids = itertools.count(1)
        self._owner: dict[int, int] = {}  # context -> run
        self._num_of_run: Counter[int] = Counter()  # run -> contexts it holds
        self._max_per_run = max_per_run
        self._copies: list[PageCopy] = []  # to send before the next pass

    # ------------------------------------------------------------------ ownership

    def check_owner(self, run_id: int, context_id: int) -> None:
        owner = self._owner.get(context_id)
        if owner is None:
            raise ContextNotFound(context_id)
        if owner != run_id:
            raise ContextNotOwned(context_id, run_id)

    def of_run(self, run_id: int) -> list[int]:
        return [c for c, r in self._owner.items() if r == run_id]

    def subscribe(self, listener: Callable[[int], None]) -> None:
        """`listener(context_id)` is called before a context is forked, truncated, punched,
        cancelled or released."""
        self._listeners.append(listener)

    def invalidate(self, context_id: int) -> None:
        for listener in self._listeners:
            listener(context_id)

    def check_idle(self, context_id: int, what: str) -> None:
        """Fork and truncate need the context's KV settled: its pending pass's pages would
        otherwise be copied before they are written, or freed under it."""
        if self._scheduler.has_pending(context_id):
            raise InvalidRequest(f"cannot {what} context {context_id} while a forward pass on it is pending")

    # ------------------------------------------------------------------ lifecycle

    def create(self, run_id: int, context_id: int = 0) -> int:
        """A new empty context of `run_id`: its id is `context_id` when one is given (a layer
        above chose it: replicas hand down ids unique across them), else the next free one."""
        self._check_count(run_id)
        context_id = self._new_id(context_id)
        self.pages.create(context_id, owner=run_id)
        self.prefix.on_create(context_id)
        self._own(context_id, run_id)
        return context_id

    def fork(self, run_id: int, context_id: int, child_id: int = 0) -> int:
        self.check_owner(run_id, context_id)
        self._check_count(run_id)
        self.invalidate(context_id)
        self.check_idle(context_id, "fork")
        # A fork shares its parent's pages; it is charged them all (its own from the first
        # write on), and the copy of the partial page.
        self.check_quota(run_id, context_id, 0, extra_pages=len(self.pages.held(context_id)) + 1)
        child = self._new_id(child_id)
        # The partial page's Copy goes out before the next pass (the loop sends copies first).
        self._copies += self.pages.fork(context_id, child, owner=run_id)
        self.prefix.on_fork(context_id, child)
        self._own(child, run_id)
        return child

    def _new_id(self, chosen: int) -> int:
        if not chosen:
            chosen = next(self._ids)
            while self.pages.has(chosen):  # ids chosen above may run ahead of the counter
                chosen = next(self._ids)
        elif chosen < 0 or self.pages.has(chosen):
            raise InvalidRequest(f"context id {chosen} is in use or invalid")
        return chosen

    def truncate(self, context_id: int, length: int) -> None:
        """The context keeps its first `length` slots; its staged chain is dropped."""
        self.invalidate(context_id)
        self.pages.truncate(context_id, length)
        self.prefix.on_truncate(context_id, length)

    def release_slots(self, context_id: int, start: int, stop: int) -> int:
        self.invalidate(context_id)
        self.check_idle(context_id, "release pages of")
        released = self.pages.release_pages(context_id, start, stop)
        if released:
            self.prefix.on_release_pages(context_id)
        return released

    def cancel_pending(self, context_id: int) -> list[Pass]:
        """Before a release: drop the staged chain and take the context's passes from the
        scheduler (the caller fails their waiters)."""
        self.invalidate(context_id)
        return self._scheduler.cancel(lambda p: p.context_id == context_id)

    def release(self, context_id: int) -> None:
        self.invalidate(context_id)
        self.pages.release(context_id)
        self.prefix.on_release(context_id)
        run_id = self._owner.pop(context_id)
        self._num_of_run[run_id] -= 1
        if not self._num_of_run[run_id]:
            del self._num_of_run[run_id]

    def _own(self, context_id: int, run_id: int) -> None:
        self._owner[context_id] = run_id
        self._num_of_run[run_id] += 1

    def _check_count(self, run_id: int) -> None:
        if self._max_per_run and self._num_of_run[run_id] >= self._max_per_run:
            raise ContextLimitExceeded(run_id, self._max_per_run)

    # ------------------------------------------------------------------ growth

    def extend(self, run_id: int, context_id: int, num_slots: int) -> None:
        """Reserve `num_slots` more slots for a pass (within the run's quota), so that it either
        gets all its pages now or fails at once (`OutOfPages`, `PageQuotaExceeded`)."""
        self.check_quota(run_id, context_id, num_slots)
        self._copies += self.pages.extend(context_id, num_slots)

    def adopt_reserved(self, context_id: int, item: Pass) -> None:
        """`item` (one decode step) was answered by a pass pre-fired into the context's next
        slot: that slot, reserved then, becomes part of the context."""
        copies = self.pages.extend(context_id, 1)
        assert not copies, "a reserved slot needed a page copy"
        self.prefix.record(context_id, item.tokens, item.positions, item.adapter_id, False)

    def take_copies(self) -> list[PageCopy]:
        copies, self._copies = self._copies, []
        return copies

    def check_quota(self, run_id: int, context_id: int, num_tokens: int, extra_pages: int = 0) -> None:
        """PageQuotaExceeded if growing `context_id` by `num_tokens` (and `extra_pages`) would
        take its run's contexts past their share of the pool. Pages shared by contexts count
        once per context: a quota errs on the side of the others."""
        if self._quota.is_unlimited:
            return
        ps = self.pages.page_size
        now = len(self.pages.pages(context_id))
        needed = max(0, -(-(self.pages.length(context_id) + num_tokens) // ps) - now) + extra_pages
        if needed == 0:
            return
        self._quota.check(run_id, needed, self.pages.held_by_owner(), self.pages.num_available)

    def may_reserve(self, run_id: int, context_id: int, num_slots: int) -> bool:
        """Whether `num_slots` past the context's length stay within its run's quota: a staged
        speculative step reserves its slot only then (the pass it serves takes that slot
        without a check of its own)."""
        try:
            self.check_quota(run_id, context_id, num_slots)
        except PageQuotaExceeded:
            return False
        return True

    def set_group(self, run_id: int, group: str) -> None:
        self._quota.set_group(run_id, group)

    def forget_run(self, run_id: int) -> None:
        self._quota.forget(run_id)

    def usage(self, run_id: int) -> tuple[int, int]:
        """(contexts, distinct KV pages) the run holds now."""
        contexts = self.of_run(run_id)
        return len(contexts), len({p for c in contexts for p in self.pages.held(c)})
