"""`host.inferlet_source`: builds on threads side by side read their inferlets' imports safely
(CPython 3.11's AST constructor shares its recursion depth between threads); a build refuses a
link out of the inferlet's folder, naming it."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest

from host.build import build
from host.inferlet_source import BuildError, external_imports, inferlet_files

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


def _inferlet(root: Path) -> Path:
    folder = root / "linked"
    (folder / "pkg").mkdir(parents=True)
    (folder / "app.py").write_text("import helper\n\ndef main(args):\n    pass\n")
    (folder / "pkg" / "real.py").write_text("x = 1\n")
    (folder / "inside.py").symlink_to(folder / "pkg" / "real.py")  # a link inside the folder is fine
    (root / "secret.py").write_text("TOKEN = 'not for the component'\n")
    (root / "secrets").mkdir()
    return folder


def test_links_inside_the_folder_are_read(tmp_path: Path) -> None:
    folder = _inferlet(tmp_path)
    files = dict(inferlet_files(folder))
    assert files["inside.py"] == files["pkg/real.py"] == "x = 1\n"


@pytest.mark.parametrize(
    ("link", "target"),
    [("helper.py", "secret.py"), ("data.txt", "secret.py"), ("vendored", "secrets")],
    ids=["module", "other-file", "folder"],
)
def test_a_link_out_of_the_folder_is_refused_naming_it(tmp_path: Path, link: str, target: str) -> None:
    folder = _inferlet(tmp_path)
    (folder / link).symlink_to(tmp_path / target)
    with pytest.raises(BuildError, match=rf"{link} links to .*{target}, outside .*linked") as info:
        build(str(folder), tmp_path / "cache")
    assert "TOKEN" not in str(info.value)
    assert not (tmp_path / "cache" / "build").exists()
