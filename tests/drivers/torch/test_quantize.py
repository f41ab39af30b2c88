"""Int8 SmolLM2 stays close to the float32 model: weight-only int8 (bf16 activations) and w8a8
(float32 activations, each matmul input row quantized to int8): the same greedy choice on most
prompt rows, high logit correlation, and it still answers the question. w8a8 quantizes each row
on its own, so a request's logits do not depend on the rest of its batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bridge_schema.messages import Hello
from drivers.errors import ConfigRejected
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.weights.checkpoint import Checkpoint
from drivers.torch.weights.quantize import DynamicInt8Linear, Int8Linear
from tests.drivers.torch.helpers import forward, load_dir, make_driver, random_tokens, request, write_tiny_llama

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("dtype", "weights", "layer"), [("bfloat16", "int8", Int8Linear), ("float32", "w8a8", DynamicInt8Linear)]
)
def test_int8_weights_track_float32(smollm2: Checkpoint, dtype: str, weights: str, layer: type) -> None:
    assert smollm2.tokenizer is not None
    ids = smollm2.tokenizer.encode(PROMPT).ids
    q8 = TorchDriver(smollm2, DriverOptions(dtype=dtype, weights=weights, num_pages=8))
    q8.handshake(Hello())
    assert isinstance(q8.model.model.layers[0].self_attn.qkv, layer)
    ref = make_driver(smollm2, num_pages=8).logits(forward([request(ids, 0, range(8), 16, all_rows=True)]))
    got = q8.logits(forward([request(ids, 0, range(8), 16, all_rows=True)]))
    same = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    corr = torch.corrcoef(torch.stack([ref.flatten(), got.flatten()]))[0, 1]
    assert same >= 0.8 and corr > 0.98
    out = [int(q8.forward(forward([request(ids, 0, range(8), 16)])).tokens[0])]
    while len(out) < 8:
        out.append(int(q8.forward(forward([request(out[-1:], len(ids) + len(out) - 1, range(8), 16)])).tokens[0]))
    assert "Paris" in smollm2.tokenizer.decode(out)


def test_w8a8_row_does_not_depend_on_its_batch(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    drv = TorchDriver(ckpt, DriverOptions(weights="w8a8", page_size=4, num_pages=40))
    drv.handshake(Hello())
    mine = request([t % 50 for t in random_tokens(9, 96, seed=1)], 0, range(0, 10), 4, all_rows=True)
    alone = drv.logits(forward([mine]))
    with torch.no_grad():  # the other rows' tokens (50 and up) get far larger activations
        drv.model.model.embed_tokens.weight[50:] *= 100
    others = [
        request([50 + t % 46 for t in random_tokens(n, 96, seed=n)], 0, range(10 * i, 10 * i + 10), 4, context_id=i)
        for i, n in ((1, 5), (2, 12))
    ]
    batched = drv.logits(forward([mine, *others]))[: len(alone)]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)


def test_weight_kinds_are_validated(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    with pytest.raises(ConfigRejected, match="bfloat16"):
        TorchDriver(ckpt, DriverOptions(dtype="float32", weights="int8"))
    with pytest.raises(ConfigRejected, match="weights"):
        TorchDriver(ckpt, DriverOptions(weights="int3"))
