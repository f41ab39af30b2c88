"""Chunked prefill equals single-pass prefill (fp32, 1e-3) for full attention and for the
sliding-window family (windows 4 and 8, chunks of 8, prompts longer than the window, continuation
chunks whose cache already holds more keys than the window), with and without user masks and
attention sinks. Each family's mask must be built for the keys its cache returns. On the CPU the
handshake asks the host for fills in chunks of 512 tokens (settable, or none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bridge_schema.messages import Hello
from drivers.torch.driver import CPU_FILL_CHUNK, DriverOptions, TorchDriver
from drivers.torch.weights.checkpoint import Checkpoint
from tests.drivers.torch.helpers import (
    brle,
    chunked_logits,
    forward,
    load_dir,
    make_driver,
    random_tokens,
    request,
    write_tiny_gemma,
    write_tiny_llama,
)

PAGES = list(range(40))
N = 29  # longer than both windows; chunks of 8 leave a continuation whose cache holds > window keys


def _ckpt(tmp_path: Path, family: str, sinks: int = 0) -> Checkpoint:
    if family == "full":
        return load_dir(write_tiny_llama(tmp_path / "m"))
    return load_dir(write_tiny_gemma(tmp_path / "m", sliding_window=int(family[-1]), num_sink_tokens=sinks))


def _single(ckpt: Checkpoint, toks: list[int], page_size: int, rows: list[list[int]] | None = None) -> torch.Tensor:
    drv = make_driver(ckpt, page_size=page_size, num_pages=40)
    return drv.logits(forward([request(toks, 0, PAGES, page_size, all_rows=True, mask_rows=rows)]))


def _sparse_rows(n: int) -> list[list[int]]:
    """Row i hides every third key below i (a pattern a positional misalignment would break)."""
    return [brle([j % 3 != 1 or j == i for j in range(n)]) for i in range(n)]


@pytest.mark.parametrize("family", ["full", "window4", "window8"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_chunked_equals_single_pass(tmp_path: Path, family: str, page_size: int) -> None:
    ckpt = _ckpt(tmp_path, family)
    toks = random_tokens(N, 96, seed=3)
    single = _single(ckpt, toks, page_size)
    chunked = chunked_logits(make_driver(ckpt, page_size=page_size, num_pages=40), toks, 8, PAGES)
    torch.testing.assert_close(chunked, single, atol=1e-3, rtol=0)


@pytest.mark.parametrize("family", ["full", "window4", "window8"])
def test_chunked_equals_single_pass_with_user_mask(tmp_path: Path, family: str) -> None:
    ckpt = _ckpt(tmp_path, family)
    toks = random_tokens(N, 96, seed=4)
    rows = _sparse_rows(N)
    single = _single(ckpt, toks, 4, rows)
    chunked = chunked_logits(make_driver(ckpt, page_size=4, num_pages=40), toks, 8, PAGES, rows)
    torch.testing.assert_close(chunked, single, atol=1e-3, rtol=0)
    # The mask changes the output: it is applied, not dropped.
    assert (single - _single(ckpt, toks, 4)).abs().max() > 1e-2


@pytest.mark.parametrize("window", [4, 8])
def test_sinks_chunked_equals_single_pass(tmp_path: Path, window: int) -> None:
    ckpt = _ckpt(tmp_path, f"window{window}", sinks=2)
    toks = random_tokens(N, 96, seed=5)
    single = _single(ckpt, toks, 4)
    chunked = chunked_logits(make_driver(ckpt, page_size=4, num_pages=40), toks, 8, PAGES)
    torch.testing.assert_close(chunked, single, atol=1e-3, rtol=0)
    no_sinks = _single(_ckpt(tmp_path / "plain", f"window{window}"), toks, 4)
    assert (single[window + 2 :] - no_sinks[window + 2 :]).abs().max() > 1e-2  # sinks are seen


@pytest.mark.parametrize(("chosen", "want"), [(-1, CPU_FILL_CHUNK), (0, 0), (100, 100)])
def test_cpu_handshake_asks_for_fills_in_chunks(tmp_path: Path, chosen: int, want: int) -> None:
    # -1 (the default): 512 on the CPU, where a long prompt in chunks attends to fewer keys.
    assert CPU_FILL_CHUNK == 512
    drv = TorchDriver(_ckpt(tmp_path, "full"), DriverOptions(num_pages=8, max_fill_chunk_tokens=chosen))
    assert drv.handshake(Hello()).max_fill_chunk_tokens == want
