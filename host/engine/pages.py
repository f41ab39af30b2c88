"""The KV page table: which pages each context holds, reference counts, the free pool.

Pure bookkeeping: it never talks to the driver. Operations that need page memory moved return the
`PageCopy` pairs the caller must send as a bridge `Copy` before the next pass touching them.
Invariant: a context writes only into pages it holds alone (refcount 1); shared pages are full
or, after a truncate, copied on the next write.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from host.engine.prefix_cache import PrefixCache
from host.errors import ContextNotFound, InvalidRequest, OutOfPages


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy page `src` to page `dst` (whole page) on the driver."""

    src: int
    dst: int


@dataclass(slots=True)
class _ContextPages:
    pages: list[int] = field(default_factory=list)
    # KV slots in use. pages[:pages_for(length)] hold them; pages past those are reserved
    # (by `reserve`, for a staged speculative write) and empty.
    length: int = 0
    owner: int = 0  # whom its pages are charged to (the engine: the run)

    def num_held(self) -> int:
        return sum(1 for p in self.pages if p != HOLE)


# A page a context released from its middle (attention sinks + window): its slots keep their
# positions but hold nothing; every later pass of the context must mask them out.
HOLE = -1


def pages_for(length: int, page_size: int) -> int:
    """Number of pages that hold `length` slots."""
    return -(-length // page_size)


class PageTable:
    """Pages are numbered 0..num_pages-1. Every failing operation leaves the table unchanged."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: PrefixCache | None = None) -> None:
        if num_pages < 0 or page_size <= 0:
            raise InvalidRequest(f"bad page pool: {num_pages} pages of {page_size} tokens")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcount = [0] * num_pages
        # A stack popped from the end: the lowest free page goes out first (deterministic ids).
        self._free = list(range(num_pages - 1, -1, -1))
        self._contexts: dict[int, _ContextPages] = {}
        # Pages held per owner, kept as they change (a quota check reads it for every pass
        # that grows a context: summing over every context there made N creations cost N^2).
        # A page shared by k contexts counts k times.
        self._held: Counter[int] = Counter()
        # Cached full pages hold one reference of their own (see host.engine.prefix_cache).
        self.prefix_cache = prefix_cache

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Free pages plus cached pages no context holds (evicted on demand)."""
        return len(self._free) + len(self._evictable())

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def has(self, context_id: int) -> bool:
        return context_id in self._contexts

    def length(self, context_id: int) -> int:
        return self._get(context_id).length

    def pages(self, context_id: int) -> tuple[int, ...]:
        """The context's page per page-sized run of slots; HOLE where it released one."""
        return tuple(self._get(context_id).pages)

    def held(self, context_id: int) -> tuple[int, ...]:
        """The pages the context holds: `pages` without the holes."""
        return tuple(p for p in self._get(context_id).pages if p != HOLE)

    def context_ids(self) -> list[int]:
        return list(self._contexts)

    def held_by_owner(self) -> Mapping[int, int]:
        """Pages held per owner (`create`'s `owner`), a page once per context that holds it."""
        return self._held

    def _charge(self, ctx: _ContextPages, num_pages: int) -> None:
        self._held[ctx.owner] += num_pages
        if not self._held[ctx.owner]:
            del self._held[ctx.owner]

    # ------------------------------------------------------------------ changes

    def create(self, context_id: int, owner: int = 0) -> None:
        if context_id in self._contexts:
            raise InvalidRequest(f"context {context_id} already exists")
        self._contexts[context_id] = _ContextPages(owner=owner)

    def fork(self, src_id: int, dst_id: int, owner: int | None = None) -> list[PageCopy]:
        """`dst_id` gets `src_id`'s tokens: full pages are shared, the partial last page is copied.
        `owner`: whom the fork's pages are charged to (`src_id`'s owner by default)."""
        src = self._get(src_id)
        if dst_id in self._contexts:
            raise InvalidRequest(f"context {dst_id} already exists")
        num_full = src.length // self.page_size
        shared = src.pages[:num_full]
        copies: list[PageCopy] = []
        pages = list(shared)
        if src.length % self.page_size:  # pages past the length are reserved, not copied
            dst_page = self._allocate(1)[0]
            copies.append(PageCopy(src.pages[num_full], dst_page))
            pages.append(dst_page)
        for page in shared:
            if page != HOLE:
                self._refcount[page] += 1
        dst = self._contexts[dst_id] = _ContextPages(pages, src.length, src.owner if owner is None else owner)
        self._charge(dst, dst.num_held())
        return copies

    def extend(self, context_id: int, num_tokens: int) -> list[PageCopy]:
        """Grow the context by `num_tokens` slots, allocating pages; a shared partial last page
        is first replaced by a private copy (returned), so the new slots never land in a page
        another context reads."""
        ctx = self._get(context_id)
        if num_tokens < 0:
            raise InvalidRequest(f"cannot extend by {num_tokens} tokens")
        if num_tokens == 0:
            return []
        is_cow = self._partial_page_is_shared(ctx)
        num_new = max(0, pages_for(ctx.length + num_tokens, self.page_size) - len(ctx.pages))
        fresh = self._allocate(num_new + int(is_cow))
        copies: list[PageCopy] = []
        if is_cow:
            index = ctx.length // self.page_size
            old, new = ctx.pages[index], fresh.pop(0)
            self._decref(old)
            ctx.pages[index] = new
            copies.append(PageCopy(old, new))
        ctx.pages.extend(fresh)
        self._charge(ctx, len(fresh))
        ctx.length += num_tokens
        return copies

    def free_slots(self, context_id: int) -> int:
        """Slots the context could grow by now: the room left in its pages, plus every page
        that could be allocated (less one for a shared partial page's copy)."""
        ctx = self._get(context_id)
        room = len(ctx.pages) * self.page_size - ctx.length
        spare = self.num_available - int(self._partial_page_is_shared(ctx))
        return room + max(spare, 0) * self.page_size

    def reserve(self, context_id: int, num_slots: int) -> bool:
        """Hold `num_slots` slots past the context's length without growing it (a staged
        speculative write lands only in slots its context holds). False, changing nothing, when
        that needs a copy-on-write or more pages than are free: speculation then just skips."""
        ctx = self._get(context_id)
        if self._partial_page_is_shared(ctx):
            return False
        num_new = pages_for(ctx.length + num_slots, self.page_size) - len(ctx.pages)
        if num_new > self.num_available:
            return False
        if num_new > 0:
            ctx.pages.extend(self._allocate(num_new))
            self._charge(ctx, num_new)
        return True

    def adopt(self, context_id: int, pages: Sequence[int]) -> None:
        """An empty context takes `pages` (full, cached pages) as its first slots."""
        ctx = self._get(context_id)
        if ctx.length or ctx.pages:
            raise InvalidRequest(f"context {context_id} is not empty: it cannot adopt cached pages")
        for page in pages:
            self._refcount[page] += 1
        ctx.pages = list(pages)
        self._charge(ctx, len(pages))
        ctx.length = len(pages) * self.page_size

    def register(self, context_id: int, index: int, key: bytes) -> bool:
        """Name the context's full page `index` in the prefix cache (which then holds it too)."""
        assert self.prefix_cache is not None
        ctx = self._get(context_id)
        assert (index + 1) * self.page_size <= ctx.length, "only full pages are cached"
        page = ctx.pages[index]
        if page == HOLE or not self.prefix_cache.insert(key, page):
            return False
        self._refcount[page] += 1
        return True

    def release_pages(self, context_id: int, start: int, stop: int) -> int:
        """Release the whole pages inside slots [start, stop) before the context's last page:
        they become holes (positions unchanged). Returns how many pages were released."""
        ctx = self._get(context_id)
        if not 0 <= start <= stop <= ctx.length:
            raise InvalidRequest(f"cannot release slots [{start}, {stop}) of a context of length {ctx.length}")
        first = -(-start // self.page_size)
        last = min(stop // self.page_size, (ctx.length - 1) // self.page_size)  # never the last page
        released = 0
        for i in range(first, last):
            if ctx.pages[i] != HOLE:
                self._decref(ctx.pages[i])
                ctx.pages[i] = HOLE
                released += 1
        self._charge(ctx, -released)
        return released

    def has_holes(self, context_id: int) -> bool:
        return HOLE in self._get(context_id).pages

    def truncate(self, context_id: int, length: int) -> None:
        """Keep the first `length` slots; pages wholly past them go back to the pool."""
        ctx = self._get(context_id)
        if not 0 <= length <= ctx.length:
            raise InvalidRequest(f"cannot truncate context {context_id} of length {ctx.length} to {length}")
        keep = pages_for(length, self.page_size)
        if length % self.page_size and keep and ctx.pages[keep - 1] == HOLE:
            raise InvalidRequest(f"cannot rewind context {context_id} into a released page")
        for page in ctx.pages[keep:]:
            if page != HOLE:
                self._decref(page)
                self._charge(ctx, -1)
        del ctx.pages[keep:]
        ctx.length = length

    def release(self, context_id: int) -> None:
        ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            raise ContextNotFound(context_id)
        self._charge(ctx, -ctx.num_held())
        for page in ctx.pages:
            if page != HOLE:
                self._decref(page)

    # ------------------------------------------------------------------ internals

    def _get(self, context_id: int) -> _ContextPages:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise ContextNotFound(context_id)
        return ctx

    def _partial_page_is_shared(self, ctx: _ContextPages) -> bool:
        if ctx.length % self.page_size == 0:
            return False
        return self._refcount[ctx.pages[ctx.length // self.page_size]] > 1

    def _evictable(self) -> list[int]:
        if self.prefix_cache is None:
            return []
        return [p for p in self.prefix_cache.by_recency() if self._refcount[p] == 1]

    def _allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            evictable = self._evictable()
            if count > len(self._free) + len(evictable):
                raise OutOfPages(count, len(self._free), self.num_pages, self.page_size)
            assert self.prefix_cache is not None
            for page in evictable[: count - len(self._free)]:  # least recently used first
                self.prefix_cache.remove(page)
                self.prefix_cache.evictions += 1
                self._decref(page)
        taken = [self._free.pop() for _ in range(count)]
        for page in taken:
            self._refcount[page] = 1
        return taken

    def _decref(self, page: int) -> None:
        assert self._refcount[page] > 0, f"page {page} freed twice"
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._free.append(page)


def copy_groups(copies: Sequence[PageCopy]) -> list[list[PageCopy]]:
    """Split copies, in order, into groups a single bridge `Copy` may carry (distinct
    destinations, no destination also a source); later groups may read what earlier ones wrote."""
    groups: list[list[PageCopy]] = []
    srcs: set[int] = set()
    dsts: set[int] = set()
    for copy in copies:
        if not groups or copy.src in dsts or copy.dst in dsts or copy.dst in srcs:
            groups.append([])
            srcs, dsts = set(), set()
        groups[-1].append(copy)
        srcs.add(copy.src)
        dsts.add(copy.dst)
    return groups
