"""Every resource a run creates, by kind and rep, so the sandbox can free what the guest leaks.

wasmtime-py does not call destructors for handles a guest keeps in a global or holds when it
traps, even once the Store is gone: this table is the only record of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class ResourceKind(enum.IntEnum):
    """The host resource types of the WIT world; the values are wasmtime's host type ids."""

    CONTEXT = 1
    ADAPTER = 2
    FORWARD_PASS = 3
    GRAMMAR = 4
    MATCHER = 5


@dataclass(slots=True)
class Slot(Generic[T]):
    kind: ResourceKind
    value: T


class ResourceTable:
    """Reps are per run, start at 1, and are never reused within the run."""

    def __init__(self) -> None:
        self._next_rep = 1
        self._slots: dict[int, Slot[object]] = {}

    def add(self, kind: ResourceKind, value: object) -> int:
        rep = self._next_rep
        self._next_rep += 1
        self._slots[rep] = Slot(kind, value)
        return rep

    def get(self, kind: ResourceKind, rep: int) -> object:
        slot = self._slots.get(rep)
        if slot is None or slot.kind is not kind:
            raise KeyError(f"no live {kind.name.lower()} with handle {rep}")
        return slot.value

    def remove(self, kind: ResourceKind, rep: int) -> object | None:
        """Forget `rep`; its value, or None if it was already gone (a second drop is harmless)."""
        slot = self._slots.get(rep)
        if slot is None or slot.kind is not kind:
            return None
        del self._slots[rep]
        return slot.value

    def drain(self) -> list[Slot[object]]:
        """Everything still live, removed from the table (used at run end)."""
        slots = list(self._slots.values())
        self._slots.clear()
        return slots

    def __len__(self) -> int:
        return len(self._slots)
