"""Window/sink rows and page dropping, checked against dense boolean masks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from host.engine.attention_masks import drop_unattended_pages, from_intervals, true_intervals, window_rows


def dense(row: list[int]) -> np.ndarray:
    out, value = [], False
    for run in row:
        out += [value] * run
        value = not value
    return np.array(out, dtype=bool)


def test_window_rows_attend_to_sinks_and_the_window() -> None:
    rows = window_rows(kv_start=6, num_tokens=2, window=3, sinks=2)
    assert [dense(r).tolist() for r in rows] == [
        # keys 0..7; query slot 6: sinks 0,1 and window 4,5,6 (7 is cut by causality in the driver)
        [True, True, False, False, True, True, True, True],
        [True, True, False, False, False, True, True, True],
    ]
    assert all(sum(r) == 8 for r in rows)


def test_short_contexts_see_everything() -> None:
    (row,) = window_rows(kv_start=2, num_tokens=1, window=8, sinks=4)
    assert dense(row).all()


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    context=st.integers(0, 120),
    num_new=st.integers(1, 6),
    window=st.integers(1, 40),
    sinks=st.integers(0, 6),
)
def test_dropping_pages_keeps_exactly_the_attended_keys(
    page_size: int, context: int, num_new: int, window: int, sinks: int
) -> None:
    kv_len = context + num_new
    num_pages = -(-kv_len // page_size)
    pages = list(range(100, 100 + num_pages))
    last = kv_len - (num_pages - 1) * page_size
    rows = window_rows(context, num_new, window, sinks)
    kept, new_last, new_rows = drop_unattended_pages(pages, last, num_new, rows, page_size)
    # Keys of the kept pages, in order; every row's attended keys survive, in the same order.
    slots = np.concatenate([np.arange(i * page_size, (i + 1) * page_size) for i, p in enumerate(pages) if p in kept])
    slots = slots[: (len(kept) - 1) * page_size + new_last]
    for row, new_row in zip(rows, new_rows, strict=True):
        assert sum(new_row) == len(slots)
        np.testing.assert_array_equal(np.flatnonzero(dense(row)), slots[dense(new_row)])
    assert kept[-1] == pages[-1] and new_last == last  # the written pages stay
    if window + sinks + page_size * 2 < context:
        assert len(kept) < len(pages)  # a long context really sheds pages


def test_intervals_round_trip() -> None:
    row = [2, 3, 0, 0, 4, 1, 5]
    assert from_intervals(true_intervals(row), sum(row)) == [2, 3, 4, 1, 5]
