"""Resources and run lifetime: leaked handles are freed, cancellation stops a run and frees what
it holds, messages flow both ways, and a component is compiled once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from wasmtime.component import Component

from host.build import build
from host.sandbox import BufferedRunIO, RunStatus, Sandbox, SandboxConfig
from host.sandbox.compile_cache import CompileCache
from host.sandbox.errors import ComponentLoadError
from host.sandbox.wasm_engine import new_engine
from tests.host.sandbox.table_services import TableServices


@pytest.mark.parametrize("ending", ["returns", "then-fail"])
def test_leaked_context_handles_are_freed(
    sandbox: Sandbox, misbehave: Component, services: TableServices, ending: str
) -> None:
    args = ["leak", "3"] + (["then-fail"] if ending == "then-fail" else [])
    handle = sandbox.start(misbehave, services, args)
    outcome = handle.wait(timeout_s=120)
    assert outcome.output == "leaked"
    assert outcome.status is (RunStatus.OK if ending == "returns" else RunStatus.GUEST_ERROR)
    assert outcome.num_leaked_resources == 3
    assert services.num_released == 3  # released one by one, not only swept by end_run
    assert services.live_contexts(handle.run_id) == []
    assert handle.run_id in services.ended_runs


def test_cancelling_a_decoding_run_stops_it_and_frees_its_contexts(sandbox: Sandbox, misbehave: Component) -> None:
    services = TableServices(forward_delay_s=0.001)
    handle = sandbox.start(misbehave, services, ["decode_forever"])
    assert services.forward_started.wait(timeout=120)
    assert services.live_contexts(handle.run_id)
    handle.cancel()
    outcome = handle.wait(timeout_s=120)
    assert outcome.status is RunStatus.CANCELLED
    assert outcome.output == "decoding"
    assert services.live_contexts(handle.run_id) == []
    assert handle.run_id in services.ended_runs


def test_cancelling_a_run_blocked_on_receive(sandbox: Sandbox, misbehave: Component, services: TableServices) -> None:
    io = BufferedRunIO()
    handle = sandbox.start(misbehave, services, ["wait"], io=io)
    while io.output != "waiting":
        assert not handle.is_done, handle.wait().error
        time.sleep(0.01)
    handle.cancel()
    assert handle.wait(timeout_s=120).status is RunStatus.CANCELLED


def test_messages_flow_both_ways(sandbox: Sandbox, misbehave: Component, services: TableServices) -> None:
    io = BufferedRunIO()
    for message in ("one", "two"):
        io.push(message)
    io.close()
    outcome = sandbox.run(misbehave, services, ["echo"], io=io)
    assert outcome.status is RunStatus.OK, outcome.error
    assert outcome.output == "ONETWO"


def test_streamed_chunks_reach_the_callback(sandbox: Sandbox, misbehave: Component, services: TableServices) -> None:
    chunks: list[str] = []
    outcome = sandbox.run(misbehave, services, ["decode", "2"], io=BufferedRunIO(on_chunk=chunks.append))
    assert outcome.status is RunStatus.OK, outcome.error
    assert chunks == ["71,72"]


def test_many_concurrent_runs_each_get_their_own_results(sandbox: Sandbox, misbehave: Component) -> None:
    services = TableServices()
    handles = [sandbox.start(misbehave, services, ["decode", str(n)]) for n in range(1, 17)]
    for n, handle in zip(range(1, 17), handles, strict=True):
        outcome = handle.wait(timeout_s=300)
        assert outcome.status is RunStatus.OK, outcome.error
        assert outcome.output == ",".join(str(71 + i) for i in range(n))
    assert services.live_contexts() == []


def test_compiled_component_is_cached_on_disk(misbehave: Component, cache_dir: Path) -> None:
    wasm = build(str(Path(__file__).parent / "inferlets" / "misbehave"), cache_dir).wasm_path
    cache = CompileCache(new_engine(), cache_dir / "compiled")
    compiled = cache.compiled_path(wasm)
    assert compiled.exists()  # written when the session's sandbox first loaded the component
    inode = compiled.stat().st_ino
    # A fresh cache (as in a new process) deserializes it; a compile would replace the file.
    assert cache.load(wasm) is not None
    assert compiled.stat().st_ino == inode


def test_a_file_that_is_not_a_component_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.wasm"
    bogus.write_bytes(b"not wasm")
    with Sandbox(SandboxConfig(cache_dir=tmp_path)) as sb, pytest.raises(ComponentLoadError, match="not a valid"):
        sb.load(bogus)


def test_decode_through_the_stock_wasmtime_path_matches_the_raw_path(
    misbehave: Component, cache_dir: Path, services: TableServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    from host.api import inference

    monkeypatch.setattr(inference, "USE_RAW_DECODE", False)  # read when a Linker is built
    wasm = build(str(Path(__file__).parent / "inferlets" / "misbehave"), cache_dir).wasm_path
    with Sandbox(SandboxConfig(cache_dir=cache_dir)) as stock:
        outcome = stock.run(stock.load(wasm), services, ["decode", "5"])
    assert outcome.status is RunStatus.OK, outcome.error
    assert outcome.output == "71,72,73,74,75"


def test_an_adapter_the_engine_refuses_is_an_error_the_guest_can_handle(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    outcome = sandbox.run(misbehave, services, ["adapter", "no-such-lora"])
    assert outcome.status is RunStatus.OK, outcome.error
    assert outcome.output == "refused: no adapter named 'no-such-lora'"


def test_an_error_the_guest_returns_after_a_cancel_ends_the_run_cancelled(
    sandbox: Sandbox, misbehave: Component, services: TableServices
) -> None:
    """A cancel that lands while the guest is between host calls: the guest goes on and returns
    its own error (here deliberately; in practice, the error of a call the cancel failed). The
    run ended because it was cancelled, so it is CANCELLED, not GUEST_ERROR."""
    handles: list[object] = []
    started = threading.Event()

    def cancel_on_output(_chunk: str) -> None:
        started.wait(timeout=60)
        handles[0].cancel()  # type: ignore[attr-defined]

    handle = sandbox.start(misbehave, services, ["leak", "1", "then-fail"], io=BufferedRunIO(on_chunk=cancel_on_output))
    handles.append(handle)
    started.set()
    outcome = handle.wait(timeout_s=120)
    assert outcome.status is RunStatus.CANCELLED, (outcome.status, outcome.error)
    assert "failing while holding contexts" in (outcome.error or "")  # what the guest said is kept
