"""Decode passes through `cuda_graphs.DecodeGraphs` give the plain Triton path's logits and leave
every context's cache as the plain path leaves it: batch sizes padded into buckets, a bucket
reused with fewer rows after its rows' pages went to another context. Without a GPU the buckets
run uncaptured over the same static inputs, through Triton's interpreter; with TRITON_INTERPRET=0
on a CUDA machine (`make gpu-check`) the same tests capture and replay real graphs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bridge_schema.messages import Hello
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.runners import cuda_graphs
from drivers.torch.runners.cuda_graphs import DecodeGraphs, buckets
from drivers.torch.weights.checkpoint import Checkpoint
from tests.drivers.torch.helpers import forward, load_dir, random_tokens, request, write_tiny_gemma

pytest.importorskip("triton")

PS = 4
ON_GPU = os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available()


def _pages(ctx: int) -> list[int]:
    return [3 * ctx, 3 * ctx + 1, 3 * ctx + 2]  # context 0 holds page 0, slot 0


def _driver(ckpt: Checkpoint, graphs: bool) -> TorchDriver:
    options = DriverOptions(device="cuda" if ON_GPU else "cpu", page_size=PS, num_pages=16, cuda_graphs=graphs)
    drv = TorchDriver(ckpt, options)
    drv.handshake(Hello())
    if not ON_GPU:
        drv.use_triton = True  # the device picks the backend; the test forces the interpreter
        if graphs:
            assert drv.cache is not None and drv.limits is not None
            drv.graphs = DecodeGraphs(drv.cfg, drv.model, drv.cache, drv.limits.max_context, 8, capture=False)
    return drv


def test_buckets_cover_the_pass_limit() -> None:
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 8]
    assert buckets(64)[-1] == 64


def test_graph_buckets_equal_the_plain_path(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_gemma(tmp_path / "m", sliding_window=4, num_sink_tokens=1))
    plain, graphed = _driver(ckpt, False), _driver(ckpt, True)
    # Context 4's prompt covers slot 5 of the pages it takes over, where context 3 last wrote.
    prompts = {c: random_tokens(7 if c == 4 else 5, 96, seed=c) for c in range(5)}
    kv = {c: len(p) for c, p in prompts.items()}

    def prefill(drv: TorchDriver, ctx: int, pages_of: int) -> torch.Tensor:
        return drv.logits(forward([request(prompts[ctx], 0, _pages(pages_of), PS)]))

    def decode(drv: TorchDriver, ctxs: list[tuple[int, int]], step: int) -> torch.Tensor:
        specs = [
            request(random_tokens(1, 96, seed=100 * step + c), kv[c], _pages(p), PS, context_id=c) for c, p in ctxs
        ]
        return drv.logits(forward(specs))

    # (context, the context whose pages it holds) per pass: 4 rows in bucket 4, 1 in bucket 1, 3 in
    # bucket 4 again after context 3's pages went to context 4, 2 in bucket 2.
    steps = [[(0, 0), (1, 1), (2, 2), (3, 3)], [(1, 1)], "swap", [(0, 0), (1, 1), (2, 2)], [(4, 3), (2, 2)]]
    for drv in (plain, graphed):
        for c in range(4):
            prefill(drv, c, c)
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, step in enumerate(steps):
        if step == "swap":  # context 3 ends; context 4 takes its pages
            outs.append((prefill(plain, 4, 3), prefill(graphed, 4, 3)))
            continue
        outs.append((decode(plain, step, i), decode(graphed, step, i)))
        for c, _ in step:
            kv[c] += 1
    for want, got in outs:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert plain.cache is not None and graphed.cache is not None
    pages = slice(0, graphed.cache.spare_slot)
    torch.testing.assert_close(graphed.cache.k[:, pages], plain.cache.k[:, pages], atol=1e-5, rtol=0)
    torch.testing.assert_close(graphed.cache.v[:, pages], plain.cache.v[:, pages], atol=1e-5, rtol=0)
    assert graphed.graphs is not None and sorted(graphed.graphs.buckets) == [1, 2, 4]
    assert graphed.graphs.passes == 4 and not graphed.graphs.disabled
    if ON_GPU:
        assert all(b.graph is not None for b in graphed.graphs.buckets.values())


def test_ineligible_passes_take_the_plain_path(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_gemma(tmp_path / "m", sliding_window=4))
    drv = _driver(ckpt, True)
    drv.logits(forward([request(random_tokens(5, 96, seed=1), 0, _pages(0), PS)]))  # prefill
    drv.logits(forward([request([7], 5, _pages(0), PS, mask_rows=[[0, 6]])]))  # a user mask
    assert drv.graphs is not None and drv.graphs.passes == 0 and not drv.graphs.buckets


@pytest.mark.skipif(ON_GPU, reason="fakes a failed capture on the CPU")
def test_a_failed_capture_turns_graphs_off_and_the_plain_path_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = load_dir(write_tiny_gemma(tmp_path / "m", sliding_window=4))
    plain, graphed = _driver(ckpt, False), _driver(ckpt, True)
    assert graphed.graphs is not None
    graphed.graphs.capture = True  # as on CUDA, where the warm-up before the capture fails here

    calls = []

    def fail(*_: object) -> None:
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "_on_side_stream", fail)
    prompt = random_tokens(5, 96, seed=3)
    outs = []
    for drv in (plain, graphed):
        drv.logits(forward([request(prompt, 0, _pages(0), PS)]))
        outs.append(drv.logits(forward([request([9], 5, _pages(0), PS)])))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=0)
    assert "operation not permitted" in graphed.graphs.disabled and graphed.graphs.passes == 0
    assert "CUDA graphs off" in caplog.text
    # Off for good: the next decode pass does not try again.
    graphed.logits(forward([request([4], 6, _pages(0), PS)]))
    assert graphed.graphs.passes == 0 and len(calls) == 1
