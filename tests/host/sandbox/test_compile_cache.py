"""`CompileCache`: a compile never holds up loads of other components, two loads of one
component compile it once, inferlets on wafer's base share one compiled component, and the
components kept in memory are bounded (least recently used dropped)."""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path

import pytest
from wasmtime.component import Component

from host.app_bundle import SECTION_NAME, split_sources
from host.build import build
from host.sandbox.compile_cache import CompileCache, LoadedInferlet
from host.sandbox.config import MIB
from host.sandbox.errors import ComponentLoadError
from host.sandbox.wasm_engine import new_engine

HERE = Path(__file__).parent
REPO = HERE.parents[2]


@pytest.fixture(scope="module")
def wasm(cache_dir: Path) -> Path:
    return build(str(HERE / "inferlets" / "misbehave"), cache_dir).wasm_path


def _variant(wasm: Path, tmp_path: Path, tag: str) -> Path:
    """The component with a custom section of its own: another component to the cache (its
    bytes differ), which runs exactly like the original."""
    name = b"test-pad"
    body = bytes([len(name)]) + name + tag.encode()
    assert len(body) < 128  # one-byte LEB128 size
    path = tmp_path / f"{tag}.wasm"
    path.write_bytes(wasm.read_bytes() + bytes([0, len(body)]) + body)
    return path


@pytest.fixture(scope="module")
def variant(wasm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _variant(wasm, tmp_path_factory.mktemp("variant"), "v1")


def test_a_slow_compile_does_not_hold_up_other_loads(
    wasm: Path, variant: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = CompileCache(new_engine(), cache_dir / "compiled")
    cache.load(wasm)
    inner = cache._load_uncached
    release, in_compile = threading.Event(), threading.Event()

    def held(key: str, path: Path, data: bytes, progress: object = None) -> tuple[Component, int]:
        if path == variant:
            in_compile.set()
            assert release.wait(60), "never released"
        return inner(key, path, data, None)

    monkeypatch.setattr(cache, "_load_uncached", held)
    results: list[LoadedInferlet] = []
    compiling = threading.Thread(target=lambda: results.append(cache.load(variant)))
    compiling.start()
    assert in_compile.wait(60)
    # While `variant` compiles, a component already loaded comes back at once (under the old
    # cache-wide lock this waited for the compile, and this thread would block until release).
    other = threading.Thread(target=lambda: results.append(cache.load(wasm)))
    other.start()
    other.join(30)
    assert not other.is_alive() and len(results) == 1
    release.set()
    compiling.join(60)
    assert len(results) == 2 and cache.num_loaded == 2


def test_loads_of_one_component_compile_it_once(
    wasm: Path, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = CompileCache(new_engine(), cache_dir / "compiled")
    copies = [tmp_path / f"copy{i}.wasm" for i in range(4)]  # four files, one component
    for path in copies:
        shutil.copyfile(wasm, path)
    inner, calls = cache._load_uncached, []

    def counted(key: str, p: Path, data: bytes, progress: object = None) -> tuple[Component, int]:
        calls.append(p)
        return inner(key, p, data, None)

    monkeypatch.setattr(cache, "_load_uncached", counted)
    got: list[LoadedInferlet] = []
    threads = [threading.Thread(target=lambda p=p: got.append(cache.load(p))) for p in copies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(calls) == 1 and len(got) == 4 and all(c.component is got[0].component for c in got)
    assert cache.num_loaded == 1


def test_inferlets_on_the_base_share_one_compiled_component(cache_dir: Path) -> None:
    hello, text = (build(name, cache_dir) for name in ("hello", "text_completion"))
    assert hello.kind == text.kind == "base"
    cache = CompileCache(new_engine(), cache_dir / "compiled")
    first, second = cache.load(hello.wasm_path), cache.load(text.wasm_path)
    assert first.component is second.component and cache.num_loaded == 1
    assert first.app is not None and second.app is not None
    assert dict(first.app.files)["app.py"] == (REPO / "inferlets" / "hello" / "app.py").read_text()
    assert dict(second.app.files)["app.py"] == (REPO / "inferlets" / "text_completion" / "app.py").read_text()
    assert cache.compiled_path(hello.wasm_path) == cache.compiled_path(text.wasm_path)


def test_loaded_components_are_bounded(wasm: Path, variant: Path, tmp_path: Path, cache_dir: Path) -> None:
    on_base = build("hello", cache_dir).wasm_path
    warm = CompileCache(new_engine(), cache_dir / "compiled")
    for path in (wasm, variant, on_base):
        warm.load(path)  # compiled on disk, so the sizes are known
    sizes = {path: warm.compiled_path(path).stat().st_size for path in (wasm, variant, on_base)}
    cache = CompileCache(new_engine(), cache_dir / "compiled", max_loaded_bytes=sizes[wasm] + sizes[on_base])
    first = cache.load(wasm)
    cache.load(variant)
    assert cache.load(wasm).component is first.component  # still loaded, and now the most recently used
    cache.load(on_base)  # past the bound: `variant` (least recently used) is dropped
    assert cache.num_loaded == 2
    assert cache.load(wasm).component is first.component
    assert cache.load(variant) is not None  # loads again from the compiled file


def test_a_forgotten_component_leaves_memory_and_disk_unless_another_file_has_it(
    wasm: Path, tmp_path: Path, cache_dir: Path
) -> None:
    cache = CompileCache(new_engine(), tmp_path / "compiled")
    gone = _variant(wasm, tmp_path, "forget-me")
    cache.load(gone)
    compiled = cache.compiled_path(gone)
    assert compiled.exists() and cache.num_loaded == 1
    cache.forget(hashlib.sha256(gone.read_bytes()).hexdigest(), gone)
    assert not compiled.exists() and cache.num_loaded == 0
    # Inferlets on the base share a compiled component: forgetting one file's keeps it for the other.
    hello, text = (build(name, cache_dir).wasm_path for name in ("hello", "text_completion"))
    kept = cache.load(hello).component
    cache.load(text)
    base, _ = split_sources(text.read_bytes())
    cache.forget(hashlib.sha256(base).hexdigest(), text)
    assert cache.compiled_path(hello).exists() and cache.load(hello).component is kept


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


def test_a_malformed_sources_section_is_a_clear_load_error(cache_dir: Path, tmp_path: Path) -> None:
    """An inferlet whose `wafer-app` section is not what the build writes (an upload, say) is
    refused naming the section, not passed on as a half-read inferlet."""
    base = build("hello", cache_dir).wasm_path.read_bytes()
    component, _ = split_sources(base)
    name = SECTION_NAME.encode()
    body = bytes([len(name)]) + name + b"{not json"
    bad = tmp_path / "bad_sources.wasm"
    bad.write_bytes(component + bytes([0, len(body)]) + body)
    with pytest.raises(ComponentLoadError, match="is not a valid inferlet: the wafer-app section is not JSON"):
        CompileCache(new_engine(), cache_dir / "compiled").load(bad)
