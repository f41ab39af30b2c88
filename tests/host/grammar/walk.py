"""Test helpers: read a bitmask back into token ids, and walk a grammar with random tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from host.grammar import Matcher, allocate_bitmask

# Bytes that close what is open (strings, objects, arrays); a walk prefers them once it is long.
CLOSERS = tuple(b'"}]') + tuple(b"0123456789")


def allowed_ids(mask: npt.NDArray[np.uint32], vocab_size: int) -> npt.NDArray[np.intp]:
    """Token ids whose bit is set: bit j of word i is token 32*i + j."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(
    matcher: Matcher,
    rng: random.Random,
    *,
    max_steps: int = 400,
    soft_steps: int = 40,
    prefer: Sequence[int] = (),
) -> list[int]:
    """Accept random allowed tokens until the matcher terminates; returns the tokens (stop included).

    After `soft_steps` the walk picks stop tokens, then `prefer` tokens, whenever allowed, so that
    it ends. Every chosen token must be accepted: the mask and the matcher must agree.
    """
    mask = allocate_bitmask(matcher.vocab_size)
    stops = set(matcher.grammar.stop_token_ids)
    preferred = set(prefer)
    tokens: list[int] = []
    for step in range(max_steps):
        if matcher.is_terminated():
            return tokens
        matcher.fill_bitmask(mask)
        allowed = allowed_ids(mask, matcher.vocab_size).tolist()
        assert allowed, f"no token allowed after {tokens!r}"
        if step >= soft_steps:
            narrowed = [t for t in allowed if t in stops] or [t for t in allowed if t in preferred]
            allowed = narrowed or allowed
        token = rng.choice(allowed)
        assert matcher.accept(token), f"masked-in token {token} refused after {tokens!r}"
        tokens.append(token)
    raise AssertionError(f"no termination within {max_steps} steps: {tokens!r}")


def text_of(tokens: Sequence[int], table: Sequence[bytes]) -> str:
    return b"".join(table[t] for t in tokens).decode("utf-8")
