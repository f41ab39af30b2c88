"""LoRA adapter names and the table of adapters loaded on the driver. A name is a name: it is
resolved only inside the configured adapter directory (never an absolute path, never `..`), and
at most `max_loaded` adapters stay loaded (the least recently used one that no run holds is
unloaded first). Pure: it decides, the engine sends the driver's load and unload messages."""

from __future__ import annotations

import posixpath
import re
from collections import OrderedDict
from collections.abc import Set
from dataclasses import dataclass, field

# One segment of a name: letters, digits, '_', '.', '-', not starting with '.' (so never '.' or
# '..'); segments are separated by '/'.
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
MAX_NAME_CHARS = 200


class AdapterNameError(ValueError):
    """The name cannot name an adapter (or adapters are off): the message says why."""


class AdapterSlotsFull(RuntimeError):
    """Every loaded adapter is held by a running run: none can be unloaded for a new one."""


def resolve(adapter_dir: str, name: str) -> str:
    """The driver-side path of adapter `name`: `adapter_dir/name`."""
    if not adapter_dir:
        raise AdapterNameError(
            "adapters are off: no adapter directory is configured (the daemon's adapter_dir, "
            "or --adapter-dir for wafer run)"
        )
    segments = name.split("/")
    if len(name) > MAX_NAME_CHARS or not all(_SEGMENT.fullmatch(s) for s in segments):
        raise AdapterNameError(
            f"adapter {name!r} is not a name inside the adapter directory: use segments of letters, digits, "
            f"'_', '.' and '-' separated by '/', none starting with '.', at most {MAX_NAME_CHARS} characters "
            "(no absolute paths, no '..')"
        )
    return posixpath.join(adapter_dir, *segments)


@dataclass
class AdapterTable:
    """Loaded adapters by name, least recently used first; ids are never reused."""

    max_loaded: int
    _ids: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _next_id: int = 0

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {self.max_loaded}")

    def __len__(self) -> int:
        return len(self._ids)

    def lookup(self, name: str) -> int | None:
        """The id of a loaded adapter (now the most recently used), or None."""
        adapter_id = self._ids.get(name)
        if adapter_id is not None:
            self._ids.move_to_end(name)
        return adapter_id

    def plan_load(self, in_use: Set[int]) -> tuple[int, int | None]:
        """An id for a new adapter, and the loaded adapter to unload first (None while there is
        room): the least recently used one not in `in_use`. AdapterSlotsFull if all are."""
        victim = None
        if len(self._ids) >= self.max_loaded:
            victim = next((i for i in self._ids.values() if i not in in_use), None)
            if victim is None:
                raise AdapterSlotsFull(
                    f"all {self.max_loaded} adapter slots are held by running runs (max_loaded_adapters)"
                )
        return self._next_id, victim

    def loaded(self, name: str, adapter_id: int) -> None:
        """Record that the driver loaded `name` as `adapter_id` (from `plan_load`)."""
        self._ids[name] = adapter_id
        self._next_id = max(self._next_id, adapter_id + 1)

    def unloaded(self, adapter_id: int) -> None:
        """Record that the driver unloaded `adapter_id`."""
        for name, i in self._ids.items():
            if i == adapter_id:
                del self._ids[name]
                return
