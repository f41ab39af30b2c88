"""`wafer dev`'s watcher (host/cli/dev_loop.py): which runs a sequence of edits starts. The whole
command, with real builds, is tests/e2e/test_cli.py::test_dev_reruns_the_inferlet_after_each_change."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from host.cli import dev_loop


def test_a_save_that_truncates_then_writes_starts_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that empties the file and writes it 60 ms later (a busy machine's save) is one
    change: the run after it reads the whole file, and no run reads the empty one."""
    monkeypatch.setattr(dev_loop, "POLL_S", 0.01)  # the watcher looks inside the empty moment
    monkeypatch.setattr(dev_loop, "SETTLE_S", 0.3, raising=False)  # well past it, even when busy
    app = tmp_path / "app.py"
    app.write_text("v1\n")
    first_run = threading.Event()

    def edit() -> None:
        first_run.wait(10)
        time.sleep(0.05)
        with app.open("w") as f:  # truncated here
            f.flush()
            time.sleep(0.06)
            f.write("v2 = 'the whole file'\n")
        time.sleep(1.0)  # past two settling looks
        app.write_text("stop\n")

    seen: list[str] = []

    def run_once(changed: Callable[[], bool]) -> None:
        seen.append(app.read_text())
        first_run.set()
        if seen[-1] == "stop\n":
            raise KeyboardInterrupt

    editor = threading.Thread(target=edit)
    editor.start()
    with pytest.raises(KeyboardInterrupt):
        dev_loop.watch(tmp_path, run_once, lambda message: None)
    editor.join()
    assert seen == ["v1\n", "v2 = 'the whole file'\n", "stop\n"]


def test_a_change_during_a_run_starts_the_next_at_once(tmp_path: Path) -> None:
    """`changed()` turns true when the files change during a run, and the next run follows."""
    app = tmp_path / "app.py"
    app.write_text("one\n")
    seen: list[tuple[str, bool, bool]] = []

    def run_once(changed: Callable[[], bool]) -> None:
        text, before = app.read_text(), changed()
        if text == "one\n":
            app.write_text("two, written during the first run\n")
            seen.append((text, before, changed()))
            return
        seen.append((text, before, changed()))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dev_loop.watch(tmp_path, run_once, lambda message: None)
    assert seen == [("one\n", False, True), ("two, written during the first run\n", False, False)]
