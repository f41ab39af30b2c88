"""The hierarchical attention rule (pure Python, no SDK): which keys a query attends to, and
the BRLE mask rows that say so. The README states the rule; this module is its one definition."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Hierarchy:
    """Chunks of `chunk` tokens (slots 0.., the whole context); a query at slot q in chunk
    c = q // chunk attends to everything before it when c == 0, else to the union of: the first
    `sinks` slots; the first `summary` slots of every chunk 0..c; the whole of the `top` chunks
    among 0..c-1 scoring highest (score >= 1; ties: the later chunk); and the `window` slots
    ending at q. A chunk's score is the number of distinct tokens it shares with the
    `query_tokens` tokens ending at q."""

    chunk: int
    summary: int
    top: int
    window: int
    sinks: int = 0
    query_tokens: int = 16
    _chunk_sets: list[frozenset[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.window < 1 or self.query_tokens < 1:
            raise ValueError("chunk, window and query tokens must be >= 1")
        if min(self.summary, self.top, self.sinks) < 0:
            raise ValueError("summary, top and sinks must be >= 0")

    def top_chunks(self, tokens: Sequence[int], query: int) -> list[int]:
        """The chunks whose whole body `query` attends to, best first."""
        before = query // self.chunk  # chunks 0 .. before-1 are complete and before the query
        while len(self._chunk_sets) < before:  # contexts only grow: chunk sets never change
            j = len(self._chunk_sets)
            self._chunk_sets.append(frozenset(tokens[j * self.chunk : (j + 1) * self.chunk]))
        recent = set(tokens[max(0, query - self.query_tokens + 1) : query + 1])
        scored = [(len(self._chunk_sets[j] & recent), j) for j in range(before)]
        return [j for score, j in sorted(scored, reverse=True)[: self.top] if score > 0]

    def intervals(self, tokens: Sequence[int], query: int) -> list[tuple[int, int]]:
        """The sorted, disjoint [start, stop) slot ranges the query at `query` attends to."""
        end = query + 1
        own = query // self.chunk
        if own == 0:
            return [(0, end)]
        spans = [(0, self.sinks), (max(0, end - self.window), end)]
        spans += [(j * self.chunk, j * self.chunk + self.summary) for j in range(own + 1)]
        spans += [(j * self.chunk, (j + 1) * self.chunk) for j in self.top_chunks(tokens, query)]
        merged: list[tuple[int, int]] = []
        for start, stop in sorted((a, min(b, end)) for a, b in spans if min(b, end) > a):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            else:
                merged.append((start, stop))
        return merged

    def rows(self, tokens: Sequence[int], first_query: int) -> list[list[int]]:
        """Mask rows for the queries at slots first_query .. len(tokens)-1, over len(tokens)
        keys: BRLE run lengths, false run first."""
        return [brle(self.intervals(tokens, q), len(tokens)) for q in range(first_query, len(tokens))]


def brle(intervals: Sequence[tuple[int, int]], num_keys: int) -> list[int]:
    """BRLE run lengths (false run first) of sorted, disjoint [start, stop) ranges."""
    runs, pos = [], 0
    for start, stop in intervals:
        runs += [start - pos, stop - start]
        pos = stop
    runs.append(num_keys - pos)
    return runs
