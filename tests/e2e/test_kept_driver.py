"""`wafer driver start NAME`: a driver kept running for later runs, which connect to it instead
of starting their own (for torch, that skips the model load); status, stop, a kept driver that
died is forgotten, and a second host is refused while one is served, its user told by whom."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from host.build import build
from host.cli import kept_drivers
from host.cli.commands import EXIT_FAILED, EXIT_OK, main
from host.engine import Engine, EngineConfig
from host.errors import DriverFailed
from host.sandbox import Sandbox
from host.sandbox.config import default_cache_dir

TORCH_ARGS = ("--threads", "1", "--num-pages", "256", "--dtype", "float32")


@pytest.fixture()
def cache(tmp_path: Path) -> Iterator[Path]:
    """A cache of its own for the kept drivers, sharing the session's base and compiled code."""
    root = tmp_path / "cache"
    root.mkdir()
    shared = default_cache_dir()
    for part in ("base", "compiled", "build"):
        (shared / part).mkdir(parents=True, exist_ok=True)
        (root / part).symlink_to(shared / part)
    yield root
    for name in ("dummy", "torch"):
        kept_drivers.stop(root, name)


def test_runs_use_the_kept_driver_until_it_is_stopped(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cache-dir", str(cache), "driver", "start", "dummy", "--", "--num-pages", "77"]) == EXIT_OK
    kept = kept_drivers.find(cache, "dummy")
    assert kept is not None and kept.args == ("--num-pages", "77")
    capsys.readouterr()
    for _ in range(2):  # one host connection after another
        assert main(["--cache-dir", str(cache), "run", "hello", "--no-stdin"]) == EXIT_OK
        captured = capsys.readouterr()
        assert captured.out.startswith("Hello, world! This is dummy.")
        assert f"using the kept dummy driver (pid {kept.pid}" in captured.err
    assert main(["--cache-dir", str(cache), "driver", "status"]) == EXIT_OK
    assert f"dummy\tpid {kept.pid}\t{kept.address}" in capsys.readouterr().out
    assert main(["--cache-dir", str(cache), "run", "hello", "--no-stdin", "--fresh-driver"]) == EXIT_OK
    assert "using the kept" not in capsys.readouterr().err
    assert main(["--cache-dir", str(cache), "driver", "stop", "dummy"]) == EXIT_OK
    assert f"stopped the kept dummy driver (pid {kept.pid})" in capsys.readouterr().err
    assert kept_drivers.find(cache, "dummy") is None
    with pytest.raises(ProcessLookupError):
        os.kill(kept.pid, 0)
    assert main(["--cache-dir", str(cache), "run", "hello", "--no-stdin"]) == EXIT_OK  # a driver of its own
    assert "using the kept" not in capsys.readouterr().err


def test_a_second_start_is_refused_and_a_dead_driver_is_forgotten(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = kept_drivers.start(cache, "dummy", "drivers.dummy")
    with pytest.raises(DriverFailed, match=f"already kept \\(pid {kept.pid}\\)"):
        kept_drivers.start(cache, "dummy", "drivers.dummy")
    os.kill(kept.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while kept_drivers.find(cache, "dummy") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kept_drivers.find(cache, "dummy") is None
    assert not (cache / "drivers" / "dummy.json").exists()
    assert main(["--cache-dir", str(cache), "driver", "stop", "dummy"]) == EXIT_OK
    assert "no dummy driver is kept" in capsys.readouterr().err


def test_a_driver_that_cannot_start_says_why(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--cache-dir", str(cache), "driver", "start", "dummy", "--", "--vocab-size", "3"]
    assert main(argv) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "the dummy driver exited with status" in err and "vocab" in err
    assert main(["--cache-dir", str(cache), "driver", "start", "nonesuch"]) == 2


def test_dev_engines_fall_back_to_a_fresh_driver_of_the_kept_kind(cache: Path) -> None:
    """`wafer dev`'s options on a kept dummy driver: its configuration names the kept driver's
    address, and the fallback a fresh built-in dummy driver with the run's own arguments."""
    from host.cli.cli_engines import engine_configs, fresh_configs
    from host.cli.commands import build_parser

    parser, _ = build_parser()
    argv = ["--cache-dir", str(cache), "dev", "hello", "--driver-arg=--num-pages", "--driver-arg=9"]
    kept = kept_drivers.start(cache, "dummy", "drivers.dummy")
    configs = engine_configs(parser.parse_args(argv), lambda _: None)
    assert [c.driver for c in configs] == [kept.address]
    fresh = fresh_configs(parser.parse_args(argv), configs)
    assert fresh[0] is not None and fresh[0].driver == "dummy" and fresh[0].driver_args == ("--num-pages", "9")
    own = parser.parse_args([*argv, "--fresh-driver"])
    assert fresh_configs(own, engine_configs(own, lambda _: None)) == [None]  # no kept driver in use: no fallback


def test_a_second_run_is_told_who_holds_the_kept_driver(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kept = kept_drivers.start(cache, "dummy", "drivers.dummy")
    with Engine.start(EngineConfig(driver=kept.address)):  # a host holding the kept driver
        assert main(["--cache-dir", str(cache), "run", "hello", "--no-stdin"]) == EXIT_FAILED
        err = capsys.readouterr().err
        assert f"wafer: error: the driver at {kept.address} is busy: " in err
        assert f"another host holds it: pid {os.getpid()} (" in err and "--fresh-driver" in err
    assert main(["--cache-dir", str(cache), "run", "hello", "--no-stdin"]) == EXIT_OK  # served once it left
    assert capsys.readouterr().out.startswith("Hello, world! This is dummy.")


def test_two_hosts_on_a_kept_torch_driver(cache: Path, cache_dir: Path, sandbox: Sandbox) -> None:
    """The acceptance test of one host at a time: while host A runs, host B is refused, and A's
    greedy output is its output alone; once A has left, B is served and gets its own alone too."""
    kept = kept_drivers.start(cache, "torch", "drivers.torch", TORCH_ARGS, timeout_s=300)
    config = EngineConfig(driver=kept.address, page_size=16, speculation_depth=1, startup_timeout_s=300)
    component = sandbox.load(build("text_completion", cache_dir).wasm_path)
    args_a = ["--prompt", "The capital of France is", "--max-tokens", "12"]
    args_b = ["--prompt", "My favourite animal is the cat, because", "--max-tokens", "8"]

    def alone(args: list[str]) -> str:
        with Engine.start(config) as engine:
            outcome = sandbox.run(component, engine, args)
        assert outcome.is_ok, outcome.error
        return outcome.output

    a_alone, b_alone = alone(args_a), alone(args_b)
    refusal: DriverFailed | None = None
    with Engine.start(config) as host_a:
        run_a = sandbox.start(component, host_a, args_a)
        try:
            with Engine.start(config) as host_b:  # refused; without the guard, a second run on A's pages
                sandbox.run(component, host_b, args_b)
        except DriverFailed as exc:
            refusal = exc
        outcome_a = run_a.wait()
    assert outcome_a.is_ok and outcome_a.output == a_alone
    assert refusal is not None and f"another host holds it: pid {os.getpid()} (" in str(refusal)
    assert alone(args_b) == b_alone  # served once A has left, on pages A and the others wrote


def test_run_model_implies_the_torch_driver_and_names_a_bad_file(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`wafer run --model M`: the torch driver (no --driver given) with `--model M` first in its
    arguments; a kept driver serving another model is not used; a file that is no model ends the
    run with one line naming it."""
    from host.cli.cli_engines import _model_of, engine_configs
    from host.cli.commands import build_parser

    parser, _ = build_parser()
    ns = parser.parse_args(["--cache-dir", str(cache), "run", "hello", "--model", "/m.gguf", "--driver-arg=-v"])
    (config,) = engine_configs(ns, lambda _: None)
    assert config.driver == "torch" and config.driver_args == ("--model", "/m.gguf", "-v")
    with pytest.raises(ValueError, match="only the torch driver loads a model"):
        engine_configs(parser.parse_args(["run", "hello", "--model", "/m.gguf", "--driver", "dummy"]), print)
    assert _model_of(("--threads", "2")) == "smollm2" and _model_of(("--model", "a", "--model=b")) == "b"
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    assert main(["--cache-dir", str(cache), "run", "hello", "--no-stdin", "--model", str(bad)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{bad} is not a readable GGUF file" in err and "Traceback" not in err, err
