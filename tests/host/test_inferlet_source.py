"""`host.inferlet_source`: builds on threads side by side read their inferlets' imports safely
(CPython 3.11's AST constructor shares its recursion depth between threads)."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

from host.inferlet_source import external_imports, inferlet_files

MISBEHAVE = Path(__file__).parent / "sandbox" / "inferlets" / "misbehave"


class _ReleasesTheGil:
    """Garbage whose finalizer lets another thread run in the middle of a parse."""

    def __del__(self) -> None:
        time.sleep(0)


def test_imports_are_read_safely_from_several_threads_at_once() -> None:
    files = inferlet_files(MISBEHAVE)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(150):
                junk = [_ReleasesTheGil() for _ in range(20)]
                for item in junk:
                    item.cycle = item  # type: ignore[attr-defined]  # freed by the gc, mid-parse
                del junk
                external_imports(files)
        except BaseException as exc:  # SystemError: AST constructor recursion depth mismatch
            errors.append(exc)

    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*thresholds)
    assert not errors, errors[0]
