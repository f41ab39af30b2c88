"""The `wafer` command line: build errors point at file and line; `run` streams and reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.cli import EXIT_FAILED, EXIT_OK, main


def _write_inferlet(root: Path, source: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "app.py").write_text(source)
    return root


def test_build_reports_a_syntax_error_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _write_inferlet(tmp_path / "broken", 'from inferlet import emit\n\ndef main(args):\n    emit("x"\n')
    assert main(["--cache-dir", str(tmp_path / "cache"), "build", str(folder)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{folder / 'app.py'}:4" in err
    assert "SyntaxError" in err


def test_build_reports_an_import_time_error_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = "from inferlet import emit\n\n\nvalue = undefined_name + 1\n\n\ndef main(args):\n    pass\n"
    folder = _write_inferlet(tmp_path / "broken_import", source)
    assert main(["--cache-dir", str(tmp_path / "cache"), "build", str(folder)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{folder / 'app.py'}:4: NameError: name 'undefined_name' is not defined" in err
    assert not list((tmp_path / "cache" / "build").glob("*.wasm"))


def test_build_without_an_app_module_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["--cache-dir", str(tmp_path), "build", str(tmp_path / "empty")]) == EXIT_FAILED
    assert "app.py" in capsys.readouterr().err


def test_run_streams_the_completion(
    built: dict[str, Path], cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--cache-dir", str(cache_dir), "run", "text_completion", "--", "--prompt", "Hi", "--max-tokens", "4"]
    assert main(argv) == EXIT_OK
    assert capsys.readouterr().out.endswith("\n")


def test_run_reports_the_inferlets_error(
    built: dict[str, Path], cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--cache-dir", str(cache_dir), "run", "text_completion", "--driver", "loopback", "--", "--max-tokens", "4"]
    assert main(argv) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "guest_error" in err
    assert "--prompt" in err
