"""Argument checks at the SDK's edge: a wrong type raises `TypeError` naming the argument, in
the author's call (the traceback shows their file and line), instead of a panic in the guest
runtime when the value reaches the host."""

from __future__ import annotations

from typing import Any


def need(value: Any, kinds: type | tuple[type, ...], what: str) -> None:
    """TypeError unless `value` is one of `kinds` (a bool is not a number here)."""
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in _as_tuple(kinds)):
        return
    names = " or ".join(k.__name__ for k in _as_tuple(kinds))
    raise TypeError(f"{what} must be {names}, not {type(value).__name__}")


def need_ints(values: Any, what: str) -> list[int]:
    """`values` as a list of ints: TypeError naming `what` if it is not an iterable of ints."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what} must be an iterable of int, not {type(values).__name__}")
    out = list(values)
    for i, v in enumerate(out):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{what}[{i}] must be int, not {type(v).__name__}")
    return out


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)
