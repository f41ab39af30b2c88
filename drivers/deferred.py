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

# Contexts remembered at most. A deferred request follows its source pass within a pass or two,
# so evicting the least recently sampled contexts beyond this never drops one still needed.
MAX_CONTEXTS = 1 << 16


class DeferredTokens:
    def __init__(self, max_contexts: int = MAX_CONTEXTS) -> None:
        self._last: dict[int, int] = {}  # context id -> the token last sampled; oldest first
        self._max_contexts = max_contexts
        self.num_filled = 0  # deferred tokens filled in (reported by `Health`)

    def resolve(self, f: Forward) -> Forward:
        """`f` with its deferred requests' first tokens filled in (`f` itself when none)."""
        if not len(f.deferred):
            return f
        first = f.token_indptr[f.deferred]
        tokens = f.tokens.copy()  # decoded arrays are read-only views of the frame
        for index, ctx in zip(first.tolist(), f.context_ids[f.deferred].tolist(), strict=True):
            token = self._last.get(ctx)
            if token is None:
                raise RequestRejected(f"context {ctx} has no sampled token to continue from", "deferred")
            tokens[index] = token
        self.num_filled += len(first)
        return dataclasses.replace(f, tokens=tokens)

    def record(self, f: Forward, result: ForwardResult) -> None:
        """Remember, per context of `f`, the token of its request's last output row."""
        ends = f.out_indptr[1:].astype(np.int64)
        has_output = ends > f.out_indptr[:-1]
        if not np.count_nonzero(has_output):
            return
        tokens = result.tokens[ends[has_output] - 1].tolist()
        last = self._last
        for ctx, token in zip(f.context_ids[has_output].tolist(), tokens, strict=True):
            last.pop(ctx, None)  # re-inserted last: the dict stays ordered by recency
            last[ctx] = token
        if len(last) > self._max_contexts:
            for ctx in list(last)[: len(last) - self._max_contexts]:
                del last[ctx]

    def forget(self, f: Forward) -> None:
        """A pass failed: its contexts' remembered tokens may no longer be what the host expects."""
        for ctx in f.context_ids.tolist():
            self._last.pop(ctx, None)
