"""The whole driver on the Triton path (interpreter on the CPU) gives the torch path's logits:
a sliding-window model with sinks, chunked prefill with a user mask, then decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.drivers.torch.helpers import (
    brle,
    chunked_logits,
    forward,
    load_dir,
    make_driver,
    random_tokens,
    request,
    write_tiny_gemma,
)

pytest.importorskip("triton")

PAGES = list(range(16))[::-1]


def test_triton_path_equals_torch_path(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_gemma(tmp_path / "m", sliding_window=4, num_sink_tokens=1))
    toks = random_tokens(20, 96, seed=11)
    rows = [brle([j % 4 != 2 or j == i for j in range(20)]) for i in range(20)]
    results = []
    for use_triton in (False, True):
        drv = make_driver(ckpt, page_size=4, num_pages=16)
        drv.use_triton = use_triton  # the device picks the backend; the test forces the interpreter
        logits = chunked_logits(drv, toks[:16], 8, PAGES, rows)
        decoded = [drv.logits(forward([request(toks[i : i + 1], i, PAGES, 4)])) for i in range(16, 20)]
        results.append(torch.cat([logits, *decoded]))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=0)
