"""Attention and logit constraints an inferlet puts on its passes.

Masks are compact on purpose: a `Window` is two numbers for every row of every pass, and a
`LogitMask` is a few run lengths over the vocabulary, so little crosses the sandbox boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """Attend to the `size` most recent keys (the token's own included), plus the first `sinks`
    keys of the context (attention sinks). Set it as `Context.attention`."""

    size: int
    sinks: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or self.sinks < 0:
            raise ValueError("a window covers at least one key, and sinks are >= 0")


@dataclass(frozen=True)
class LogitMask:
    """Which tokens a sampled row may produce, as BRLE run lengths over the vocabulary (false
    run first). Build one with `LogitMask.allow(...)` or `LogitMask.forbid(...)`."""

    runs: tuple[int, ...]

    @staticmethod
    def allow(token_ids: Iterable[int], vocab_size: int) -> LogitMask:
        return LogitMask(_runs(set(token_ids), vocab_size, allowed=True))

    @staticmethod
    def forbid(token_ids: Iterable[int], vocab_size: int) -> LogitMask:
        return LogitMask(_runs(set(token_ids), vocab_size, allowed=False))


def _runs(ids: set[int], vocab_size: int, allowed: bool) -> tuple[int, ...]:
    """BRLE runs (false first) over the vocabulary, in O(ids log ids): `ids` are the true tokens
    (`allowed`) or the false ones; ids outside the vocabulary are ignored."""
    spans: list[list[int]] = []  # the ids as [start, end) spans of consecutive tokens
    for token in sorted(t for t in ids if 0 <= t < vocab_size):
        if spans and spans[-1][1] == token:
            spans[-1][1] = token + 1
        else:
            spans.append([token, token + 1])
    if not allowed:  # the true spans are the gaps between the forbidden ones
        gaps, cursor = [], 0
        for start, end in spans:
            if start > cursor:
                gaps.append([cursor, start])
            cursor = end
        if cursor < vocab_size:
            gaps.append([cursor, vocab_size])
        spans = gaps
    runs: list[int] = []
    cursor = 0
    for start, end in spans:
        runs += [start - cursor, end - start]
        cursor = end
    if cursor < vocab_size or not runs:
        runs.append(vocab_size - cursor)
    return tuple(runs)
