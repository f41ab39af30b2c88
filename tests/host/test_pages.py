"""The page table: refcounts, fork sharing, copy-on-write after truncate, out-of-pages.

The state machine simulates page memory (what the driver would hold) and checks after every step
that each context reads back exactly its own tokens, so a page written while shared, or a copy
that was not returned, fails it.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, MultipleResults, RuleBasedStateMachine, consumes, invariant, multiple, rule

from host.engine.pages import HOLE, PageCopy, PageTable, copy_groups
from host.errors import ContextNotFound, InvalidRequest, OutOfPages


def test_extend_allocates_whole_pages() -> None:
    table = PageTable(num_pages=8, page_size=4)
    table.create(1)
    assert table.extend(1, 5) == []
    assert table.pages(1) == (0, 1)
    assert table.length(1) == 5
    assert table.num_free == 6
    table.extend(1, 3)
    assert table.pages(1) == (0, 1)
    table.extend(1, 1)
    assert table.pages(1) == (0, 1, 2)


def test_fork_shares_full_pages_and_copies_the_partial_one() -> None:
    table = PageTable(num_pages=8, page_size=4)
    table.create(1)
    table.extend(1, 10)  # pages 0, 1 full; page 2 holds 2 slots
    copies = table.fork(1, 2)
    assert copies == [PageCopy(src=2, dst=3)]
    assert table.pages(2) == (0, 1, 3)
    assert [table.refcount(p) for p in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert table.length(2) == 10


def test_fork_of_a_page_aligned_context_copies_nothing() -> None:
    table = PageTable(num_pages=4, page_size=4)
    table.create(1)
    table.extend(1, 8)
    assert table.fork(1, 2) == []
    assert table.refcount(0) == table.refcount(1) == 2


def test_release_frees_only_unshared_pages() -> None:
    table = PageTable(num_pages=8, page_size=4)
    table.create(1)
    table.extend(1, 10)
    table.fork(1, 2)
    table.release(1)
    assert table.refcount(0) == 1 and table.refcount(2) == 0
    assert table.num_free == 5
    table.release(2)
    assert table.num_free == 8
    with pytest.raises(ContextNotFound):
        table.release(2)


def test_writing_after_truncating_into_a_shared_page_copies_it_first() -> None:
    table = PageTable(num_pages=8, page_size=4)
    table.create(1)
    table.extend(1, 8)
    table.fork(1, 2)
    table.truncate(2, 6)  # page 1 is now partial for context 2 and still shared with context 1
    assert table.pages(2) == (0, 1)
    copies = table.extend(2, 1)
    assert copies == [PageCopy(src=1, dst=2)]
    assert table.pages(2) == (0, 2)
    assert table.refcount(1) == 1


def test_out_of_pages_is_immediate_and_changes_nothing() -> None:
    table = PageTable(num_pages=2, page_size=4)
    table.create(1)
    table.extend(1, 6)
    with pytest.raises(OutOfPages, match="need 1 more page"):
        table.extend(1, 3)
    assert table.length(1) == 6 and table.num_free == 0
    with pytest.raises(OutOfPages):
        table.fork(1, 2)
    assert not table.has(2)


def test_invalid_arguments() -> None:
    table = PageTable(num_pages=2, page_size=4)
    table.create(1)
    with pytest.raises(InvalidRequest):
        table.create(1)
    with pytest.raises(InvalidRequest):
        table.truncate(1, 1)
    with pytest.raises(InvalidRequest):
        table.extend(1, -1)
    with pytest.raises(ContextNotFound):
        table.extend(7, 1)


def test_copy_groups_never_read_a_page_written_in_the_same_group() -> None:
    chain = [PageCopy(1, 2), PageCopy(2, 3), PageCopy(4, 5)]
    assert copy_groups(chain) == [[PageCopy(1, 2)], [PageCopy(2, 3), PageCopy(4, 5)]]
    assert copy_groups([PageCopy(1, 2), PageCopy(1, 3)]) == [[PageCopy(1, 2), PageCopy(1, 3)]]
    assert copy_groups([]) == []


def test_a_context_truncated_onto_released_pages_keeps_its_last_slot_page() -> None:
    """Found by the state machine below: a truncate to a page boundary may leave the context
    ending in a released page (its next write goes to a new page); release_pages then must
    still not touch the page of the last slot, and the context grows normally."""
    table = PageTable(num_pages=8, page_size=3)
    table.create(1)
    table.extend(1, 4)
    assert table.release_pages(1, 0, 3) == 1
    table.truncate(1, 3)
    assert table.pages(1) == (HOLE,)
    assert table.release_pages(1, 1, 1) == 0 and table.pages(1) == (HOLE,)
    table.extend(1, 1)
    assert table.pages(1)[0] == HOLE and table.pages(1)[1] != HOLE and table.length(1) == 4


class PageTableMachine(RuleBasedStateMachine):
    contexts = Bundle("contexts")

    def __init__(self) -> None:
        super().__init__()
        self.page_size = 3
        self.table = PageTable(num_pages=12, page_size=self.page_size)
        self.memory: dict[int, list[object]] = {p: [None] * self.page_size for p in range(12)}
        self.expected: dict[int, list[object]] = {}
        self.released: dict[int, set[int]] = {}  # slots in pages a context released (holes)
        self.ids = itertools.count(1)
        self.values = itertools.count()
        self.owner: dict[int, int] = {}

    def _apply(self, copies: list[PageCopy]) -> None:
        for group in copy_groups(copies):
            snapshot = {c.src: list(self.memory[c.src]) for c in group}
            for c in group:
                self.memory[c.dst] = snapshot[c.src]

    @rule(target=contexts)
    def create(self) -> int:
        cid = next(self.ids)
        self.owner[cid] = cid % 3
        self.table.create(cid, owner=self.owner[cid])
        self.expected[cid] = []
        self.released[cid] = set()
        return cid

    @rule(cid=contexts, n=st.integers(0, 7))
    def extend(self, cid: int, n: int) -> None:
        try:
            copies = self.table.extend(cid, n)
        except OutOfPages:
            return
        self._apply(copies)
        pages = self.table.pages(cid)
        start = len(self.expected[cid])
        for slot in range(start, start + n):
            page = pages[slot // self.page_size]
            assert self.table.refcount(page) == 1, "wrote into a shared page"
            value = next(self.values)
            self.memory[page][slot % self.page_size] = value
            self.expected[cid].append(value)

    @rule(cid=contexts, n=st.integers(1, 4))
    def reserve_and_write_staged(self, cid: int, n: int) -> None:
        """A staged speculative write: into reserved slots past the length, never committed."""
        if not self.table.reserve(cid, n):
            return
        pages = self.table.pages(cid)
        start = len(self.expected[cid])
        for slot in range(start, start + n):
            page = pages[slot // self.page_size]
            assert self.table.refcount(page) == 1, "a staged write landed in a shared page"
            self.memory[page][slot % self.page_size] = "staged"

    @rule(target=contexts, cid=contexts, owner=st.sampled_from([None, 0, 1, 2]))
    def fork(self, cid: int, owner: int | None) -> int | MultipleResults[int]:
        new = next(self.ids)
        try:
            copies = self.table.fork(cid, new, owner)
        except OutOfPages:
            assert not self.table.has(new)
            return multiple()
        self._apply(copies)
        self.owner[new] = self.owner[cid] if owner is None else owner
        self.expected[new] = list(self.expected[cid])
        self.released[new] = set(self.released[cid])
        return new

    @rule(cid=contexts, data=st.data())
    def truncate(self, cid: int, data: st.DataObject) -> None:
        length = data.draw(st.integers(0, len(self.expected[cid])))
        try:
            self.table.truncate(cid, length)
        except InvalidRequest:  # rewinding into a released page is refused, and changes nothing
            assert length % self.page_size and (length - 1) in self.released[cid]
            return
        del self.expected[cid][length:]
        self.released[cid] = {s for s in self.released[cid] if s < length}

    @rule(cid=contexts, data=st.data())
    def release_middle_pages(self, cid: int, data: st.DataObject) -> None:
        length = len(self.expected[cid])
        start = data.draw(st.integers(0, length))
        stop = data.draw(st.integers(start, length))
        before = self.table.pages(cid)
        self.table.release_pages(cid, start, stop)
        pages = self.table.pages(cid)
        for slot in range(length):
            if pages[slot // self.page_size] == HOLE:
                self.released[cid].add(slot)
        if length:  # the page of the last slot is never released (it may be a hole already, after
            # a truncate to a page boundary inside released pages)
            last = (length - 1) // self.page_size
            assert pages[last] == before[last]

    @rule(cid=consumes(contexts))
    def release(self, cid: int) -> None:
        self.table.release(cid)
        del self.expected[cid]
        del self.released[cid]

    @invariant()
    def refcounts_match_holders(self) -> None:
        holders = [0] * self.table.num_pages
        for cid in self.table.context_ids():
            for page in self.table.pages(cid):
                if page != HOLE:
                    holders[page] += 1
        assert holders == [self.table.refcount(p) for p in range(self.table.num_pages)]
        assert self.table.num_free == holders.count(0)

    @invariant()
    def pages_held_per_owner_are_kept_as_they_change(self) -> None:
        held: dict[int, int] = {}
        for cid in self.table.context_ids():
            held[self.owner[cid]] = held.get(self.owner[cid], 0) + len(self.table.held(cid))
        assert dict(self.table.held_by_owner()) == {o: n for o, n in held.items() if n}

    @invariant()
    def every_context_reads_its_own_tokens(self) -> None:
        for cid, tokens in self.expected.items():
            pages = self.table.pages(cid)
            assert len(pages) >= -(-len(tokens) // self.page_size)
            kept = [i for i in range(len(tokens)) if i not in self.released[cid]]
            assert all(pages[i // self.page_size] == HOLE for i in self.released[cid])
            read = [self.memory[pages[i // self.page_size]][i % self.page_size] for i in kept]
            assert read == [tokens[i] for i in kept]


PageTableMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestPageTable = PageTableMachine.TestCase
