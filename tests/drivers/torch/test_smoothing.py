"""Activation smoothing before w8a8 (`smoothing.py`) leaves the float model's outputs unchanged
(Llama with q/k/v biases, Gemma with offset and sandwich norms and GQA), never writes the
checkpoint's tensors, and makes w8a8 SmolLM2 track float32 more closely than without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bridge_schema.messages import Hello
from drivers.torch.driver import DriverOptions, TorchDriver, build_model
from drivers.torch.model import Transformer
from drivers.torch.weights.checkpoint import Checkpoint
from drivers.torch.weights.fusion import fuse_projections
from drivers.torch.weights.smoothing import causal_attention, smooth
from tests.drivers.torch.helpers import forward, load_dir, random_tokens, request, write_tiny_gemma, write_tiny_llama


def _logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    with torch.inference_mode():
        return model(
            ids, torch.arange(len(tokens)), causal_attention(model.cfg.scale), torch.arange(len(tokens))
        ).clone()


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_smoothing_keeps_the_float_model(tmp_path: Path, arch: str) -> None:
    path = write_tiny_llama(tmp_path / "m") if arch == "llama" else write_tiny_gemma(tmp_path / "m", sliding_window=64)
    ckpt = load_dir(path)
    model = fuse_projections(build_model(ckpt, torch.device("cpu"), torch.float32))
    for block in model.model.blocks():  # q/k/v biases (Qwen2 has them): the value rows' are divided too
        qkv = block.self_attn.qkv
        assert qkv is not None
        qkv.bias = torch.nn.Parameter(torch.randn(qkv.weight.shape[0], generator=torch.Generator().manual_seed(1)))
    tokens = random_tokens(23, 96, seed=3)
    before = _logits(model, tokens)
    # Large scales: calibration on other tokens, and an outlier channel in the norms' weights.
    smooth(model, random_tokens(40, 96, seed=9))
    after = _logits(model, tokens)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert not torch.equal(
        model.model.layers[0].self_attn.qkv.weight,
        fuse_projections(build_model(ckpt, torch.device("cpu"), torch.float32)).model.layers[0].self_attn.qkv.weight,
    )  # it did change the weights


def test_smoothing_never_writes_the_checkpoint(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    state = {name: t.clone() for name, t in ckpt.state.items()}
    TorchDriver(ckpt, DriverOptions(weights="w8a8", num_pages=8))
    assert all(torch.equal(ckpt.state[name], t) for name, t in state.items())


PROMPTS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the mountains,",
]


def test_smoothing_makes_w8a8_track_float32_closer(smollm2: Checkpoint) -> None:
    assert smollm2.tokenizer is not None
    drivers = {
        name: TorchDriver(smollm2, DriverOptions(num_pages=8, **opts))
        for name, opts in (
            ("float32", {}),
            ("smooth", {"weights": "w8a8"}),
            ("plain", {"weights": "w8a8", "smooth": False}),
        )
    }
    for drv in drivers.values():
        drv.handshake(Hello())
    for prompt in PROMPTS:
        ids = smollm2.tokenizer.encode(prompt).ids
        logits = {n: d.logits(forward([request(ids, 0, range(8), 16, all_rows=True)])) for n, d in drivers.items()}
        corr = {
            n: float(torch.corrcoef(torch.stack([logits["float32"].flatten(), logits[n].flatten()]))[0, 1])
            for n in ("smooth", "plain")
        }
        assert corr["smooth"] > corr["plain"] and corr["smooth"] > 0.99, (prompt, corr)
