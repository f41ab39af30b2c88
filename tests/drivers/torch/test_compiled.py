"""The compiled path (`--compile`) equals the eager one on a tiny random Gemma-style model with
sliding windows, attention sinks and user masks: chunked prefill, a mixed prefill batch, decode at
batch 3 and at batch 1 (both the whole stack as one graph). After the handshake's warm-up no pass
compiles again; passes with LoRA run eager. One compiled model per module (compiling costs
seconds)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bridge_schema.messages import Adapter, Hello
from drivers.errors import ConfigRejected
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.runners.compiled import CompiledModel
from drivers.torch.weights.checkpoint import Checkpoint
from drivers.torch.weights.cpu_layout import TransposedLinear
from tests.drivers.torch.helpers import (
    brle,
    chunked_logits,
    forward,
    load_dir,
    make_driver,
    random_tokens,
    request,
    write_adapter,
    write_tiny_gemma,
)

PS = 4
PAGES = list(range(40))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return load_dir(write_tiny_gemma(tmp_path_factory.mktemp("gemma") / "m", sliding_window=4, num_sink_tokens=2))


@pytest.fixture(scope="module")
def compiled(gemma: Checkpoint) -> Iterator[TorchDriver]:
    drv = TorchDriver(gemma, DriverOptions(page_size=PS, num_pages=len(PAGES), compile=True))
    drv.handshake(Hello())
    with torch.compiler.set_stance("fail_on_recompile"):  # the warm-up compiled every graph
        yield drv


def test_chunked_prefill_with_user_mask_equals_eager(gemma: Checkpoint, compiled: TorchDriver) -> None:
    n = 29
    toks = random_tokens(n, 96, seed=3)
    rows = [brle([j % 3 != 1 or j == i for j in range(n)]) for i in range(n)]
    got = chunked_logits(compiled, toks, 8, PAGES, rows)
    want = chunked_logits(make_driver(gemma, page_size=PS, num_pages=len(PAGES)), toks, 8, PAGES, rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def _decode(drv: TorchDriver, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill `prompts` in one pass, decode `steps` at the full batch, then one step of the first
    context alone; the logits of every pass. Context i owns pages 10 i .. 10 i + 9."""

    def pages(i: int) -> list[int]:
        return PAGES[10 * i : 10 * i + 10]

    out = [drv.logits(forward([request(p, 0, pages(i), PS, context_id=i) for i, p in enumerate(prompts)]))]
    last = out[-1].argmax(-1).tolist()
    lengths = [len(p) for p in prompts]
    for step in range(steps + 1):
        live = range(len(prompts)) if step < steps else range(1)
        specs = [request([last[i]], lengths[i] + step, pages(i), PS, context_id=i) for i in live]
        out.append(drv.logits(forward(specs)))
        last = out[-1].argmax(-1).tolist()
    return out


def test_mixed_batch_and_decode_equal_eager(gemma: Checkpoint, compiled: TorchDriver) -> None:
    prompts = [random_tokens(n, 96, seed=n) for n in (5, 9, 13)]
    got = _decode(compiled, prompts, steps=3)
    want = _decode(make_driver(gemma, page_size=PS, num_pages=len(PAGES)), prompts, steps=3)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_pass_runs_the_stack_as_one_graph(
    gemma: Checkpoint, compiled: TorchDriver, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    # Per-layer compiled calls cost ~100 us each in dynamo and Inductor's wrapper: decode must not
    # pay them 30 times a step, at batch 1 or in a batch of contexts (the warm-up compiled both).
    assert compiled.compiled is not None
    prompts = [random_tokens(n, 96, seed=n) for n in (4, 7, 2)][:batch]
    specs = [request(p, 0, PAGES[30 + 3 * i :], PS, context_id=i) for i, p in enumerate(prompts)]
    compiled.logits(forward(specs))
    steps = [request([5], len(p), PAGES[30 + 3 * i :], PS, context_id=i) for i, p in enumerate(prompts)]

    def fail(*args: object) -> torch.Tensor:
        raise AssertionError("a decode pass called the per-layer graph")

    with monkeypatch.context() as patched:
        patched.setattr(compiled.compiled, "_layer", fail)
        patched.setattr(compiled.compiled, "_logits", fail)
        logits = compiled.logits(forward(steps))
    assert logits.shape == (batch, 96)
    eager = make_driver(gemma, page_size=PS, num_pages=len(PAGES))
    eager.logits(forward(specs))
    torch.testing.assert_close(logits, eager.logits(forward(steps)), atol=1e-4, rtol=0)
    if batch > 1:  # a context that asks for no output: the stack's logits of the others only
        quiet = [
            request([6], len(p) + 1, PAGES[30 + 3 * i :], PS, context_id=i, outputs=[] if i == 1 else None)
            for i, p in enumerate(prompts)
        ]
        got = compiled.logits(forward(quiet))
        assert got.shape == (batch - 1, 96)
        torch.testing.assert_close(got, eager.logits(forward(quiet)), atol=1e-4, rtol=0)


def _rows_of_a_matmul_depend_on_the_batch(drv: TorchDriver, rows: int) -> bool:
    """Whether torch's float32 matmul gives a row other bits alone than among `rows` rows, for one
    of the model's projections (`TransposedLinear`: x @ w). It does on aarch64 (torch's wheel
    multiplies with NVPL BLAS) at every size; with MKL on x86 not at 1-3 rows."""
    generator = torch.Generator().manual_seed(0)
    for module in drv.model.modules():
        if isinstance(module, TransposedLinear):
            x = torch.randn(rows, module.weight_t.shape[0], generator=generator)
            if not torch.equal((x[:1] @ module.weight_t)[0], (x @ module.weight_t)[0]):
                return True
    return False


def test_decode_logits_are_the_same_bits_alone_and_in_a_batch(compiled: TorchDriver) -> None:
    # Batch 1 runs the stack's graph compiled for one token, larger batches the graph with a
    # symbolic batch size: a context's logits (embedding, RoPE and all) must not depend on which.
    if _rows_of_a_matmul_depend_on_the_batch(compiled, 3):
        pytest.skip(f"this CPU's float32 matmul gives a row other bits alone and among 3 rows ({_blas()})")
    prompts = [random_tokens(n, 96, seed=n) for n in (9, 5, 7)]
    specs = [request(p, 0, PAGES[3 * i :], PS, context_id=i) for i, p in enumerate(prompts)]
    compiled.logits(forward(specs))
    for step in range(4):  # each pass writes the same token to the same slot: the caches agree
        steps = [
            request([7 + step + i], len(p) + step, PAGES[3 * i :], PS, context_id=i) for i, p in enumerate(prompts)
        ]
        alone = compiled.logits(forward(steps[:1]))
        together = compiled.logits(forward(steps))
        assert torch.equal(alone[0], together[0]), f"step {step}: batch 1 and batch 3 differ"


def _blas() -> str:
    found = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    return f"BLAS: {found[1] if found else 'unknown'}"


def _assert_no_guards_over_the_cache(drv: TorchDriver) -> None:
    assert drv.compiled is not None
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(drv.compiled._stack._fn.__code__)
    assert entries, "the warm-up compiled the stack"
    for entry in entries:
        guards = str(entry.guard_manager)
        assert "L['tokens']" in guards and "L['caches']" not in guards


def test_the_decode_stack_has_no_guards_over_the_kv_cache(compiled: TorchDriver) -> None:
    # The cache's 2 x layers page tensors are frozen arguments of the stack (the same tensors at
    # every pass): ~480 of its ~700 guards were over them.
    _assert_no_guards_over_the_cache(compiled)


def test_a_new_cache_compiles_anew_and_decodes_like_eager(gemma: Checkpoint) -> None:
    # A handshake with another page count makes new pages: the graphs that froze the old ones are
    # not called with the new ones (they would raise FrozenArgumentChanged); new ones compile.
    prompts = [random_tokens(n, 96, seed=n) for n in (5, 9)]
    with torch.compiler.set_stance("default"):  # the module's fixture forbids compiling
        drv = TorchDriver(gemma, DriverOptions(page_size=PS, num_pages=len(PAGES), compile=True))
        drv.handshake(Hello())
        _decode(drv, prompts, steps=1)
        first = drv.compiled
        drv.handshake(Hello(num_pages=len(PAGES) + 8))
        assert drv.compiled is not first
        got = _decode(drv, prompts, steps=2)
    # The new pages are frozen too, not sizes dynamo saw change (which made them symbols, with
    # guards over them, when every copy of the stack shared one name).
    _assert_no_guards_over_the_cache(drv)
    want = _decode(make_driver(gemma, page_size=PS, num_pages=len(PAGES)), prompts, steps=2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_compiled_passes_skip_dynamo_after_the_warm_up(
    gemma: Checkpoint, compiled: TorchDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through dynamo a batch-1 decode step cost ~1.1 ms more than checking its guards and calling
    # the graph (`direct_graphs.py`); every graph exists after the handshake's warm-up.
    assert compiled.compiled is not None
    graphs = [compiled.compiled._stack, compiled.compiled._layer, compiled.compiled._logits]
    before = [g.num_direct_calls for g in graphs]

    def fail(*args: object) -> torch.Tensor:
        raise AssertionError("a pass went through dynamo")

    for g in graphs:
        monkeypatch.setattr(g, "_dynamo", fail)
    prompts = [random_tokens(n, 96, seed=n) for n in (4, 7)]
    got = _decode(compiled, prompts, steps=2)  # prefill, decode batches, one-token passes
    assert all(g.num_direct_calls > n for g, n in zip(graphs, before, strict=True))
    want = _decode(make_driver(gemma, page_size=PS, num_pages=len(PAGES)), prompts, steps=2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_lora_pass_runs_eager_and_equals_eager(tmp_path: Path, gemma: Checkpoint, compiled: TorchDriver) -> None:
    eager = make_driver(gemma, page_size=PS, num_pages=len(PAGES))
    write_adapter(tmp_path / "a", gemma, seed=1)
    for drv in (compiled, eager):
        drv.adapter(Adapter(id=1, op="load", adapter_id=7, path=str(tmp_path / "a")))
    toks = random_tokens(11, 96, seed=8)
    spec = request(toks, 0, PAGES, PS, all_rows=True, adapter_id=7)
    got = compiled.logits(forward([spec]))
    torch.testing.assert_close(got, eager.logits(forward([spec])), atol=1e-4, rtol=0)
    base = compiled.logits(forward([request(toks, 0, PAGES, PS, all_rows=True)]))
    assert (got - base).abs().max() > 1e-2  # the adapter is applied


def test_each_compiled_model_compiles_its_own_code(compiled: TorchDriver) -> None:
    # Dynamo keeps graphs per code object and fails past 8 there (fullgraph): models that differ
    # in dtype or weights (3 graphs each) must not share one, or a process's third model fails.
    assert compiled.compiled is not None
    other = CompiledModel(compiled.model)
    for mine, theirs in ((compiled.compiled._layer, other._layer), (compiled.compiled._logits, other._logits)):
        assert mine._fn.__code__ is not theirs._fn.__code__


def test_compile_is_cpu_only(gemma: Checkpoint) -> None:
    with pytest.raises(ConfigRejected, match="CPU"):
        TorchDriver(gemma, DriverOptions(device="meta", compile=True))
