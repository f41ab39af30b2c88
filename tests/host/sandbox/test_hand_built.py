"""Hand-built components against the sandbox's limits: WASI at every version goes through wafer's
own clock or is refused at load; a run's memories, tables and instances are bounded together."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from host.sandbox import RunStatus, Sandbox
from host.sandbox.clocks import REFUSAL
from host.sandbox.config import MIB
from host.sandbox.errors import ComponentLoadError
from host.sandbox.imports import WASI_VERSIONS, import_problem
from tests.host.sandbox import hand_built
from tests.host.sandbox.table_services import TableServices

_HWM = Path("/proc/self/clear_refs")


@pytest.mark.parametrize("version", WASI_VERSIONS)
def test_a_clock_wait_is_refused_at_every_wasi_version(
    sandbox: Sandbox, services: TableServices, tmp_path: Path, version: str
) -> None:
    # Asleep for an hour if wasmtime's own clock answered: the wait below would time out.
    wasm = hand_built.write(hand_built.clock_sleeper(version, 3600), tmp_path / "sleeper.wasm")
    outcome = sandbox.start(sandbox.load(wasm), services).wait(timeout_s=60)
    assert outcome.status is RunStatus.TRAPPED
    assert REFUSAL in (outcome.error or "")


@pytest.mark.parametrize("version", ["0.2.10", "0.3.0", "0.3.0-rc-2025-09-16", "1.0.0"])
def test_wasi_versions_wafer_has_not_vetted_are_refused_at_load(sandbox: Sandbox, tmp_path: Path, version: str) -> None:
    wasm = hand_built.write(hand_built.clock_sleeper(version, 3600), tmp_path / "future.wasm")
    with pytest.raises(ComponentLoadError) as caught:
        sandbox.load(wasm)
    message = str(caught.value)
    assert f"wasi:clocks/monotonic-clock@{version}" in message
    assert f"wasi:io/poll@{version}" in message
    assert "0.2.0 to 0.2.9" in message


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("wasi:http/outgoing-handler@0.2.0", "does not provide this WASI interface"),
        ("wafer:inferlet/secrets@0.1.0", "has no interface 'secrets'"),
        ("wafer:inferlet/runtime@0.2.0", "at 0.1.0 only"),
        ("acme:evil/backdoor@1.0.0", "not an interface of the wafer world"),
        ("backdoor", "not an interface of the wafer world"),
    ],
)
def test_imports_outside_the_wafer_world_and_vetted_wasi_are_refused_at_load(
    sandbox: Sandbox, tmp_path: Path, name: str, why: str
) -> None:
    wasm = hand_built.write(hand_built.importing(name), tmp_path / "importer.wasm")
    with pytest.raises(ComponentLoadError, match="imports what wafer does not provide") as caught:
        sandbox.load(wasm)
    assert name in str(caught.value) and why in str(caught.value)


def test_what_python_inferlets_import_is_provided() -> None:
    for name in ("wasi:sockets/tcp@0.2.9", "wasi:cli/terminal-stderr@0.2.0", "wafer:inferlet/inference@0.1.0"):
        assert import_problem(name) is None, name


def _peak_rss_growth_mib(action: object) -> float:
    """The process's peak RSS reached while `action()` runs, above its RSS before (Linux: the
    peak is reset through clear_refs)."""
    assert callable(action)
    _HWM.write_text("5")
    before = _status_kib("VmRSS")
    action()
    return (_status_kib("VmHWM") - before) / 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _can_reset_peak_rss() -> bool:
    try:
        _HWM.write_text("5")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _can_reset_peak_rss(), reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
@pytest.mark.parametrize(
    ("text", "what"),
    [
        (hand_built.many_memories(8, 120), "memory count too high"),
        (hand_built.many_tables(6, 20_000_000), "table minimum size"),
    ],
    ids=["8-memories", "6-tables"],
)
def test_a_run_has_one_memory_budget_for_all_its_memories_and_tables(
    sandbox: Sandbox, services: TableServices, tmp_path: Path, text: str, what: str
) -> None:
    # Unbounded, 8 memories of 120 MiB took 960 MiB, 6 tables of 20 M slots 915 MiB.
    config = dataclasses.replace(sandbox.config, memory_limit_bytes=128 * MIB)
    inferlet = sandbox.load(hand_built.write(text, tmp_path / "hog.wasm"))
    outcomes = []
    growth = _peak_rss_growth_mib(lambda: outcomes.append(sandbox.start(inferlet, services, config=config).wait(60)))
    assert outcomes[0].status is RunStatus.LIMIT_EXCEEDED
    assert what in (outcomes[0].error or "") and "run_memory_mib" in (outcomes[0].error or "")
    assert growth < 128 + 64, f"peak RSS grew {growth:.0f} MiB for a run capped at 128 MiB"


def test_core_instances_are_bounded(sandbox: Sandbox, services: TableServices, tmp_path: Path) -> None:
    config = dataclasses.replace(sandbox.config, max_instances=8)
    few = hand_built.write(hand_built.many_instances(7), tmp_path / "few.wasm")
    assert sandbox.start(sandbox.load(few), services, config=config).wait(60).status is RunStatus.OK
    many = hand_built.write(hand_built.many_instances(8), tmp_path / "many.wasm")
    outcome = sandbox.start(sandbox.load(many), services, config=config).wait(60)
    assert outcome.status is RunStatus.LIMIT_EXCEEDED
    assert "instance count too high" in (outcome.error or "")


# `wafer run` with its own peak RSS (VmHWM) on stderr as it exits. Not the rusage of the child:
# Linux counts in a child's ru_maxrss the high-water mark of the process it was forked from (the
# test process, gigabytes once models are loaded), recorded when the child execs.
_WAFER_WITH_PEAK = """
import atexit, sys
from host.cli.commands import main

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("\\npeak-rss-kib " + line.split()[1] + "\\n")

atexit.register(peak)
sys.exit(main(sys.argv[1:]))
"""


def _wafer_run(wasm: Path, *options: str) -> tuple[int, str, float]:
    """`wafer run WASM` in a child process on the in-process dummy driver: its exit status, its
    stderr and its peak RSS in MiB."""
    argv = [sys.executable, "-c", _WAFER_WITH_PEAK, "run", str(wasm), "--driver", "loopback", "--no-stdin", *options]
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    peaks = [int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("peak-rss-kib ")]
    assert peaks, done.stderr
    return done.returncode, done.stderr, peaks[-1] / 1024


def test_wafer_run_refuses_the_sleeper_and_the_hogs(sandbox: Sandbox, tmp_path: Path) -> None:
    """The acceptance, through the CLI: asleep in the 0.2.0 clock with --timeout-s 5, and
    memory and table hogs at --memory-mib 256 (unbounded: 1,977 and 2,347 MiB peak RSS). Each is
    compiled into the cache first: a compile runs in a child of its own, under its own cap."""
    sleeper = hand_built.write(hand_built.clock_sleeper("0.2.0", 20), tmp_path / "sleeper.wasm")
    code, err, _ = _wafer_run(sleeper, "--timeout-s", "5")
    assert code != 0 and REFUSAL in err, err
    for name, text in (("mem", hand_built.many_memories(8, 240)), ("tab", hand_built.many_tables(6, 50_000_000))):
        hog = hand_built.write(text, tmp_path / f"{name}.wasm")
        sandbox.load(hog)
        code, err, peak_mib = _wafer_run(hog, "--memory-mib", "256")
        assert code != 0 and "the component needs more than a run may have" in err, err
        assert peak_mib <= 700, f"{name}: peak RSS {peak_mib:.0f} MiB"


@pytest.mark.parametrize("name", ["decode", "decode-all", "decode-chained"])
def test_a_raw_host_call_imported_with_another_signature_traps_cleanly(
    sandbox: Sandbox, services: TableServices, tmp_path: Path, name: str
) -> None:
    """The raw host calls read their arguments straight from wasmtime's array, which holds what
    the component declared: a component that declares none must get an error, not a read past
    the array (and the host serves the next run as before)."""
    wasm = hand_built.write(hand_built.misdeclared_host_call(name), tmp_path / f"{name}.wasm")
    outcome = sandbox.start(sandbox.load(wasm), services).wait(60)
    assert outcome.status is not RunStatus.OK
    assert f"{name} takes" in (outcome.error or ""), outcome.error
