"""Tiny random-weight checkpoints written to safetensors by the test: our Llama and Gemma-3-style
(alternating sliding-window/full) models match transformers within 1e-3 on prefill and decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.drivers.torch.helpers import (
    forward,
    hf_model,
    load_dir,
    make_driver,
    random_tokens,
    request,
    write_tiny_gemma,
    write_tiny_llama,
)

PAGES = list(range(16))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize("family", ["llama", "llama3-rope", "gemma-window4", "gemma-window8"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefill_and_decode_match_transformers(tmp_path: Path, family: str, page_size: int) -> None:
    if family == "llama":
        path = write_tiny_llama(tmp_path / "m")
    elif family == "llama3-rope":
        path = write_tiny_llama(tmp_path / "m", rope_parameters=LLAMA3_ROPE)
    else:
        path = write_tiny_gemma(tmp_path / "m", sliding_window=int(family[-1]))
    pages = list(range(64))[::-1]  # pages out of order: the page table, not adjacency, must count
    drv = make_driver(load_dir(path), page_size=page_size, num_pages=64)
    toks = random_tokens(21, 96, seed=page_size)
    ours = [drv.logits(forward([request(toks[:17], 0, pages, page_size, all_rows=True)]))]
    for i in range(17, 21):
        ours.append(drv.logits(forward([request(toks[i : i + 1], i, pages, page_size)])))
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([toks])).logits[0]
    torch.testing.assert_close(torch.cat(ours), ref, atol=1e-3, rtol=0)


def test_rope_frequencies_stay_float32_in_bf16(tmp_path: Path) -> None:
    """bf16 inverse frequencies would misplace rotations at long positions."""
    from drivers.torch.driver import DriverOptions, TorchDriver

    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    drv = TorchDriver(ckpt, DriverOptions(dtype="bfloat16"))
    assert drv.model.inv_freq.dtype == drv.model.inv_freq_local.dtype == torch.float32
    assert drv.model.model.embed_tokens.weight.dtype == torch.bfloat16
