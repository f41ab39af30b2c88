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
    runs: list[int] = []
    value, length = False, 0
    for token in range(vocab_size):
        bit = (token in ids) == allowed
        if bit != value:
            runs.append(length)
            value, length = bit, 0
        length += 1
    runs.append(length)
    return tuple(runs)
