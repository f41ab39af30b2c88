"""End-to-end fixtures: the real engine on the dummy driver (a subprocess over a Unix socket),
one Sandbox, and the example inferlets built once per session (cached on disk across sessions)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from wasmtime.component import Component

from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox import Sandbox, SandboxConfig
from host.sandbox.config import default_cache_dir

REPO = Path(__file__).resolve().parents[2]
# The examples, and the sandbox tests' misbehaving inferlet (here: against the real engine).
INFERLETS = ("hello", "text_completion", "parallel_generation", "beam_search", "tests/host/sandbox/inferlets/misbehave")


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="session")
def built(cache_dir: Path) -> dict[str, Path]:
    # Builds are subprocesses: run them side by side.
    with ThreadPoolExecutor(max_workers=len(INFERLETS)) as pool:
        results = pool.map(lambda name: build(name if "/" not in name else str(REPO / name), cache_dir), INFERLETS)
        return {r.name: r.wasm_path for r in results}


@pytest.fixture(scope="session")
def sandbox(cache_dir: Path) -> Iterator[Sandbox]:
    with Sandbox(SandboxConfig(cache_dir=cache_dir, inactivity_timeout_s=30.0)) as sb:
        yield sb


@pytest.fixture(scope="session")
def components(sandbox: Sandbox, built: dict[str, Path]) -> dict[str, Component]:
    return {name: sandbox.load(path) for name, path in built.items()}


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    # The dummy acks adapter loads without reading files: the directory need not exist.
    with Engine.start(EngineConfig(driver="dummy", speculation_depth=1, adapter_dir="/adapters")) as eng:
        yield eng
