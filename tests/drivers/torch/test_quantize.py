"""int8 weight-only SmolLM2 (bf16 activations) stays close to the float32 model: the same greedy
choice on most prompt rows, high logit correlation, and it still answers the question."""

from __future__ import annotations

import torch

from bridge_schema.messages import Hello
from drivers.torch.checkpoint import Checkpoint
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.quantize import Int8Linear
from tests.drivers.torch.helpers import forward, make_driver, request

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_int8_weights_track_float32(smollm2: Checkpoint) -> None:
    assert smollm2.tokenizer is not None
    ids = smollm2.tokenizer.encode(PROMPT).ids
    q8 = TorchDriver(smollm2, DriverOptions(dtype="bfloat16", weights="int8", num_pages=8))
    q8.handshake(Hello())
    assert isinstance(q8.model.model.layers[0].self_attn.qkv, Int8Linear)
    ref = make_driver(smollm2, num_pages=8).logits(forward([request(ids, 0, range(8), 16, all_rows=True)]))
    got = q8.logits(forward([request(ids, 0, range(8), 16, all_rows=True)]))
    same = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    corr = torch.corrcoef(torch.stack([ref.flatten(), got.flatten()]))[0, 1]
    assert same >= 0.8 and corr > 0.98
    out = [int(q8.forward(forward([request(ids, 0, range(8), 16)])).tokens[0])]
    while len(out) < 8:
        out.append(int(q8.forward(forward([request(out[-1:], len(ids) + len(out) - 1, range(8), 16)])).tokens[0]))
    assert "Paris" in smollm2.tokenizer.decode(out)
