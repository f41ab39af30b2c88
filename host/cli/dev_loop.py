"""`wafer dev`: run an inferlet, then again each time one of its files changes.

Polls the folder's Python files (path, size, modification time) a few times a second: no file
watching library, and an editor's save-by-rename counts like any other change. A change counts
once the files hold still for SETTLE_S: a save that truncates a file and then writes it is one
change, not a run of the empty file followed by another of the whole one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.3
SETTLE_S = 0.15

Fingerprint = tuple[tuple[str, int, int], ...]


def fingerprint(folder: Path) -> Fingerprint:
    out = []
    for path in sorted(folder.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        try:
            st = path.stat()
        except OSError:  # deleted while we looked
            continue
        out.append((str(path.relative_to(folder)), st.st_size, st.st_mtime_ns))
    return tuple(out)


def _differs(folder: Path, seen: Fingerprint) -> bool:
    return fingerprint(folder) != seen


def settled(folder: Path) -> Fingerprint:
    """The folder's fingerprint once two looks SETTLE_S apart agree."""
    last = fingerprint(folder)
    while True:
        time.sleep(SETTLE_S)
        now = fingerprint(folder)
        if now == last:
            return now
        last = now


def watch(
    folder: Path,
    run_once: Callable[[Callable[[], bool]], None],
    say: Callable[[str], None],
) -> None:
    """Call `run_once(changed)` now and after each change of the folder's files, until
    KeyboardInterrupt; `changed()` tells a long run that the files changed since it started, so
    it can stop early (a change during a run starts the next one at once)."""
    seen = fingerprint(folder)
    while True:
        run_once(functools.partial(_differs, folder, seen))
        say(f"watching {folder} for changes (Ctrl-C to stop)")
        while fingerprint(folder) == seen:
            time.sleep(POLL_S)
        seen = settled(folder)
        say("changed: rebuilding and running")
