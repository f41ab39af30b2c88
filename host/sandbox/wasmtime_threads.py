"""Make wasmtime-py 50's variant lowering safe when many runs call host functions at once.

Lowering an untagged `option`/`result` value fills a module-global set (`case_test_cache`) and
then tests the value against it; two threads interleaving there (the GIL may switch between the
two steps) can make a valid return value fail to lower, in the wrong run. We replace that global
with a set per thread. It is reached only through the module global, so the swap is complete.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from wasmtime.component import _types


class _PerThreadSet:
    def __init__(self) -> None:
        self._local = threading.local()

    def _set(self) -> set[type]:
        s: set[type] | None = getattr(self._local, "s", None)
        if s is None:
            s = set()
            self._local.s = s
        return s

    def clear(self) -> None:
        self._set().clear()

    def add(self, item: type) -> None:
        self._set().add(item)

    def __iter__(self) -> Iterator[type]:
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())

    def __and__(self, other: set[type]) -> set[type]:
        return self._set() & other


def install() -> None:
    """Idempotent."""
    if not isinstance(_types.case_test_cache, _PerThreadSet):
        _types.case_test_cache = _PerThreadSet()  # type: ignore[assignment]
