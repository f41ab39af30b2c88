"""Inferlets on wafer's shared base: an edit rebuilds only a file, the inferlet's modules
(packages, relative imports) are imported in the run with tracebacks naming its files, and an
inferlet that needs a module the base lacks gets a snapshot build of its own, which works."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from host.build import BuildError, build, ensure_base, external_imports, inferlet_files
from host.testing import InferletRunner

APP = """\
from inferlet import emit
from helpers import shout
from pkg.words import GREETING


def main(args):
    emit(shout(GREETING) if not args else str(fail()))


def fail():
    from pkg import broken
    return broken.value
"""
FILES = {
    "app.py": APP,
    "helpers.py": "import textwrap\n\ndef shout(text):\n    return textwrap.dedent(text).upper()\n",
    "pkg/__init__.py": "",
    "pkg/words.py": "from .tone import END\n\nGREETING = 'hello' + END\n",
    "pkg/tone.py": "END = '!'\n",
    "pkg/broken.py": "\n\nvalue = 1 / 0\n",
    "test_app.py": "import pytest\n",  # a test beside the app: never imported by it
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_what_app_imports_is_followed_through_its_own_modules(tmp_path: Path) -> None:
    files = inferlet_files(_write(tmp_path / "greeter", FILES))
    assert external_imports(files) == {"inferlet", "textwrap"}  # not pytest: test_app.py is not reached


def test_an_inferlet_with_packages_runs_on_the_base(tmp_path: Path) -> None:
    folder = _write(tmp_path / "greeter", FILES)
    with InferletRunner() as runner:
        assert build(str(folder), runner.cache_dir).kind == "base"
        result = runner.run(folder)
        assert result.ok and result.output == "HELLO!", result.error
        failed = runner.run(folder, "fail")
    assert failed.status == "guest_error"
    error = failed.error or ""
    assert f'File "{folder / "pkg" / "broken.py"}", line 3, in <module>' in error
    assert "value = 1 / 0" in error  # the source line: the loader serves it to the traceback
    assert "ZeroDivisionError" in error


def test_an_edit_makes_a_new_build_on_the_same_base_and_the_runner_picks_it_up(tmp_path: Path) -> None:
    folder = _write(tmp_path / "greeter", FILES)
    with InferletRunner() as runner:
        base = ensure_base(runner.cache_dir)
        first = build(str(folder), runner.cache_dir)
        assert runner.run(folder).output == "HELLO!"
        (folder / "pkg" / "tone.py").write_text("END = '?'\n")
        second = build(str(folder), runner.cache_dir)
        assert second.wasm_path != first.wasm_path and second.kind == "base"
        assert ensure_base(runner.cache_dir) == base  # the base was not rebuilt
        assert runner.run(folder).output == "HELLO?"


def test_a_module_the_base_lacks_gets_a_snapshot_build_that_has_it(tmp_path: Path) -> None:
    source = "import csv\nimport io\nfrom inferlet import emit\n\n\ndef main(args):\n"
    source += "    out = io.StringIO()\n    csv.writer(out).writerow(['a', 'b c'])\n    emit(out.getvalue())\n"
    folder = _write(tmp_path / "needs_csv", {"app.py": source})
    heard: list[str] = []
    with InferletRunner() as runner:
        result = build(str(folder), runner.cache_dir, heard.append)
        assert result.kind == "snapshot"
        assert any("imports csv, which wafer's base does not include" in m for m in heard)
        assert runner.run(folder).output == "a,b c\r\n"


def test_a_module_named_like_a_standard_one_is_refused_with_a_reason(tmp_path: Path) -> None:
    files = {"app.py": "from inferlet import emit\nimport json\n\n\ndef main(args):\n    emit(json.X)\n"}
    folder = _write(tmp_path / "shadow", {**files, "json.py": "X = 'mine'\n"})
    for snapshot in (False, True):
        with pytest.raises(BuildError, match=r"module 'json' has the name of a standard or SDK module.*rename it"):
            build(str(folder), tmp_path / "cache", snapshot=snapshot)


def test_a_computed_import_of_a_module_not_in_the_base_says_what_to_do(tmp_path: Path) -> None:
    source = (
        "import importlib\nfrom inferlet import emit\n\n\n"
        "def main(args):\n    importlib.import_module('sql' + 'ite3')\n"
    )
    folder = _write(tmp_path / "computed", {"app.py": source})
    with InferletRunner() as runner:
        result = runner.run(folder)
    assert result.status == "guest_error"
    assert "No module named 'sqlite3': it is not in wafer's base" in (result.error or "")
    assert "--snapshot" in (result.error or "")


def test_older_builds_of_an_edited_inferlet_are_pruned(tmp_path: Path) -> None:
    folder = _write(tmp_path / "greeter", FILES)
    cache = tmp_path / "cache"
    paths = []
    for i in range(7):
        (folder / "pkg" / "tone.py").write_text(f"END = '{i}'\n")
        paths.append(build(str(folder), cache).wasm_path)
        old = time.time() - 3600
        os.utime(paths[-1], (old + i, old + i))  # as if built an hour ago, in order
    kept = sorted((cache / "build").glob("greeter-*.wasm"))
    assert set(kept) == set(paths[-4:])
