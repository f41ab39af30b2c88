"""`CompileCache`: a compile never holds up loads of other components, two loads of one file
compile it once, and the components kept in memory are bounded (least recently used dropped)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from wasmtime.component import Component

from host.build import build
from host.sandbox.compile_cache import CompileCache
from host.sandbox.config import MIB
from host.sandbox.engine import new_engine
from host.sandbox.errors import ComponentLoadError

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def wasm(cache_dir: Path) -> Path:
    return build(str(HERE / "inferlets" / "misbehave"), cache_dir).wasm_path


def _copies(wasm: Path, tmp_path: Path, n: int) -> list[Path]:
    """n files of the same component (distinct identities; the compiled copy is shared)."""
    paths = []
    for i in range(n):
        paths.append(tmp_path / f"c{i}.wasm")
        shutil.copyfile(wasm, paths[-1])
    return paths


def test_a_slow_compile_does_not_hold_up_other_loads(
    wasm: Path, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = CompileCache(new_engine(), cache_dir / "compiled")
    loaded, slow = _copies(wasm, tmp_path, 2)
    cache.load(loaded)
    inner = cache._load_uncached
    release, in_compile = threading.Event(), threading.Event()

    def held(path: Path, progress: object = None) -> tuple[Component, int]:
        if path == slow:
            in_compile.set()
            assert release.wait(60), "never released"
        return inner(path, None)

    monkeypatch.setattr(cache, "_load_uncached", held)
    results: list[Component] = []
    compiling = threading.Thread(target=lambda: results.append(cache.load(slow)))
    compiling.start()
    assert in_compile.wait(60)
    # While `slow` compiles, a component already loaded comes back at once (under the old
    # cache-wide lock this waited for the compile, and this thread would block until release).
    other = threading.Thread(target=lambda: results.append(cache.load(loaded)))
    other.start()
    other.join(30)
    assert not other.is_alive() and len(results) == 1
    release.set()
    compiling.join(60)
    assert len(results) == 2 and cache.num_loaded == 2


def test_loads_of_one_file_compile_it_once(
    wasm: Path, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = CompileCache(new_engine(), cache_dir / "compiled")
    (path,) = _copies(wasm, tmp_path, 1)
    inner, calls = cache._load_uncached, []

    def counted(p: Path, progress: object = None) -> tuple[Component, int]:
        calls.append(p)
        return inner(p, None)

    monkeypatch.setattr(cache, "_load_uncached", counted)
    got: list[Component] = []
    threads = [threading.Thread(target=lambda: got.append(cache.load(path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(calls) == 1 and len(got) == 4 and all(c is got[0] for c in got)


def test_loaded_components_are_bounded(wasm: Path, tmp_path: Path, cache_dir: Path) -> None:
    compiled = CompileCache(new_engine(), cache_dir / "compiled").compiled_path(wasm).stat().st_size
    cache = CompileCache(new_engine(), cache_dir / "compiled", max_loaded_bytes=2 * compiled)
    paths = _copies(wasm, tmp_path, 3)
    first = cache.load(paths[0])
    cache.load(paths[1])
    assert cache.load(paths[0]) is first  # still loaded, and now the most recently used
    cache.load(paths[2])  # past the bound: paths[1] (least recently used) is dropped
    assert cache.num_loaded == 2
    assert cache.load(paths[0]) is first
    assert cache.load(paths[1]) is not None  # loads again from the compiled file


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_compile_runs_in_a_child_under_its_memory_budget(wasm: Path, tmp_path: Path) -> None:
    """The compile takes hundreds of MiB (the 18 MB chat inferlet peaked at about 430 MiB here):
    in a child, the host's memory stays where it was; past the budget the load fails saying so."""
    before = _rss_mib()
    cache = CompileCache(new_engine(), tmp_path / "compiled", compile_memory_bytes=2048 * MIB)
    component = cache.load(wasm)
    assert component is not None and cache.compiled_path(wasm).exists()
    assert _rss_mib() - before < 100  # mapped compiled code only; an in-process compile keeps far more
    tight = CompileCache(new_engine(), tmp_path / "tight", compile_memory_bytes=100 * MIB)
    with pytest.raises(ComponentLoadError, match=r"needs more than 100 MiB \(component_compile_mib\)"):
        tight.load(wasm)
    assert not tight.compiled_path(wasm).exists()  # nothing half-written is kept


def test_a_compile_is_announced_with_its_time(wasm: Path, tmp_path: Path) -> None:
    heard: list[str] = []
    cache = CompileCache(new_engine(), tmp_path / "compiled", compile_memory_bytes=2048 * MIB)
    cache.load(wasm, heard.append)
    assert len(heard) == 2 and heard[0].startswith(f"compiling {wasm.name}") and heard[1].startswith("compiled in ")
    CompileCache(new_engine(), tmp_path / "compiled").load(wasm, heard.append)  # cached: silent
    assert len(heard) == 2


def test_bytes_that_are_no_component_are_refused_by_the_child(tmp_path: Path) -> None:
    bad = tmp_path / "bad.wasm"
    bad.write_bytes(b"\0asm\x01\0\0\0 not really")
    cache = CompileCache(new_engine(), tmp_path / "compiled", compile_memory_bytes=512 * MIB)
    with pytest.raises(ComponentLoadError, match="is not a valid component"):
        cache.load(bad)
