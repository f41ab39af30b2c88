"""Deferred tokens (the "deferred_tokens" capability), kept by the serve loop for every driver
(a driver advertises the capability in its handshake; `drivers.serve` does the work).

A `Forward` may name requests whose first token is "what this driver last sampled for the same
context" (`Forward.deferred`): the host sends a context's next decode step before the reply that
carries its input token has come back, so the next pass is already queued when this one ends.
This module remembers the last sampled token per context id, fills deferred requests in from it,
and forgets the contexts of a pass that failed, so a stale token is never used: a deferred
request whose context has no remembered token is refused, naming the field.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bridge_schema.messages import Forward, ForwardResult
from drivers.errors import RequestRejected

# Contexts remembered: a deferred request follows its source pass within a pass or two, so a
# context whose token was recorded among the last MAX_CONTEXTS / 2 records is never dropped.
MAX_CONTEXTS = 1 << 16


class DeferredTokens:
    def __init__(self, max_contexts: int = MAX_CONTEXTS) -> None:
        # Context id -> the token last sampled, in two generations: records go to `_recent`
        # (one dict update per pass); when it holds half the budget it becomes `_older` and the
        # previous `_older` is dropped. Lookups try `_recent` first.
        self._recent: dict[int, int] = {}
        self._older: dict[int, int] = {}
        self._generation_size = max(1, max_contexts // 2)
        self.num_filled = 0  # deferred tokens filled in (reported by `Health`)

    def resolve(self, f: Forward) -> Forward:
        """`f` with its deferred requests' first tokens filled in (`f` itself when none)."""
        if not len(f.deferred):
            return f
        first = f.token_indptr[f.deferred]
        tokens = f.tokens.copy()  # decoded arrays are read-only views of the frame
        recent, older = self._recent, self._older
        for index, ctx in zip(first.tolist(), f.context_ids[f.deferred].tolist(), strict=True):
            token = recent.get(ctx)
            if token is None:
                token = older.get(ctx)
                if token is None:
                    raise RequestRejected(f"context {ctx} has no sampled token to continue from", "deferred")
            tokens[index] = token
        self.num_filled += len(first)
        return dataclasses.replace(f, tokens=tokens)

    def record(self, f: Forward, result: ForwardResult) -> None:
        """Remember, per context of `f`, the token of its request's last output row."""
        ptr = f.out_indptr  # validated: monotone, from 0 to the number of outputs
        r = len(f.context_ids)
        if len(result.tokens) == r and np.count_nonzero(ptr[1:] - ptr[:-1]) == r:
            # The common decode pass: one output per request (R outputs, none without one).
            self._remember(f.context_ids.tolist(), result.tokens.tolist())
            return
        ends = ptr[1:].astype(np.int64)
        has_output = ends > ptr[:-1]
        if not np.count_nonzero(has_output):
            return
        self._remember(f.context_ids[has_output].tolist(), result.tokens[ends[has_output] - 1].tolist())

    def _remember(self, contexts: list[int], tokens: list[int]) -> None:
        self._recent.update(zip(contexts, tokens, strict=True))
        if len(self._recent) >= self._generation_size:
            self._older, self._recent = self._recent, {}

    def forget(self, f: Forward) -> None:
        """A pass failed: its contexts' remembered tokens may no longer be what the host expects."""
        for ctx in f.context_ids.tolist():
            self._recent.pop(ctx, None)
            self._older.pop(ctx, None)
