"""Fixtures: the `misbehave` test inferlet is built once per session (the disk cache makes later
sessions skip the build), and one Sandbox is shared by every test, as in the host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from wasmtime.component import Component

from host.build import build
from host.sandbox import Sandbox, SandboxConfig
from host.sandbox.config import MIB, default_cache_dir
from tests.host.sandbox.table_services import TableServices

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="session")
def sandbox(cache_dir: Path) -> Iterator[Sandbox]:
    # Generous defaults; tests that exercise a limit pass their own config to `start`.
    with Sandbox(SandboxConfig(cache_dir=cache_dir, memory_limit_bytes=128 * MIB, inactivity_timeout_s=30.0)) as sb:
        yield sb


@pytest.fixture(scope="session")
def misbehave(sandbox: Sandbox, cache_dir: Path) -> Component:
    result = build(str(HERE / "inferlets" / "misbehave"), cache_dir)
    return sandbox.load(result.wasm_path)


@pytest.fixture()
def services() -> TableServices:
    return TableServices()
