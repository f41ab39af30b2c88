"""Attention masks as the host builds them (pure): the compact forms inferlets declare (a causal
window of W keys, S sink tokens) expanded into BRLE rows, and pages that no row attends to
dropped from a pass, so a windowed decode costs its window, not its whole context.

A BRLE row lists run lengths over a request's keys, false run first; drivers apply it AND causal.
"""

from __future__ import annotations

from collections.abc import Sequence


def window_rows(kv_start: int, num_tokens: int, window: int, sinks: int = 0) -> list[list[int]]:
    """Rows for tokens in slots kv_start .. kv_start+num_tokens-1: each attends to the first
    `sinks` keys and to the `window` keys ending at its own slot."""
    kv_len = kv_start + num_tokens
    rows = []
    for query in range(kv_start, kv_len):
        first = max(0, query - window + 1)
        sink = min(sinks, first)  # sinks inside the window are in it anyway
        rows.append([0, sink, first - sink, kv_len - first])
    return rows


def true_intervals(row: Sequence[int]) -> list[tuple[int, int]]:
    """The [start, stop) key ranges a BRLE row attends to."""
    out, pos, value = [], 0, False
    for run in row:
        if value and run:
            out.append((pos, pos + run))
        pos += run
        value = not value
    return out


def from_intervals(intervals: Sequence[tuple[int, int]], num_keys: int) -> list[int]:
    """The BRLE row (false first) of sorted, disjoint [start, stop) ranges over `num_keys` keys."""
    row, pos = [], 0
    for start, stop in intervals:
        row += [start - pos, stop - start]
        pos = stop
    row.append(num_keys - pos)
    return row


def drop_unattended_pages(
    pages: Sequence[int], last_page_len: int, num_new: int, rows: Sequence[Sequence[int]], page_size: int
) -> tuple[list[int], int, list[list[int]]]:
    """Leave out every page that no row attends to, except the pages the pass writes (its new
    tokens fill the last `num_new` slots), and re-base the rows onto the kept keys."""
    kv_len = (len(pages) - 1) * page_size + last_page_len
    needed = [False] * len(pages)
    for p in range((kv_len - num_new) // page_size, len(pages)):
        needed[p] = True
    per_row = [true_intervals(row) for row in rows]
    merged: list[list[int]] = []
    for start, stop in sorted(iv for ivs in per_row for iv in ivs):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    for start, stop in merged:
        for p in range(start // page_size, (stop - 1) // page_size + 1):
            needed[p] = True
    if all(needed):
        return list(pages), last_page_len, [list(r) for r in rows]
    shift, dropped = [], 0  # keys dropped before each page
    for is_needed in needed:
        shift.append(dropped)
        dropped += 0 if is_needed else page_size
    kept = [page for page, is_needed in zip(pages, needed, strict=True) if is_needed]
    new_kv = kv_len - dropped

    def rebase(key: int, is_stop: bool) -> int:
        return key - shift[(key - 1 if is_stop else key) // page_size]

    new_rows = [from_intervals([(rebase(a, False), rebase(b, True)) for a, b in ivs], new_kv) for ivs in per_row]
    return kept, last_page_len, new_rows


def attends_within(rows: Sequence[Sequence[int]], start: int, stop: int) -> bool:
    """True if some row attends to a key in [start, stop)."""
    return any(a < stop and start < b for row in rows for a, b in true_intervals(row))
