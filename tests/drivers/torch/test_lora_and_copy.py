"""LoRA adapters in PEFT safetensors format (written by the test): several adapters in one batch,
each request with its own, each equal to a model with that adapter merged into its weights.
`Copy` copies whole pages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bridge_schema.messages import Adapter, Copy
from drivers.torch.weights.checkpoint import Checkpoint
from tests.drivers.torch.helpers import (
    forward,
    load_dir,
    make_driver,
    random_tokens,
    request,
    write_adapter,
    write_tiny_llama,
)


def _merged(ckpt: Checkpoint, deltas: dict[str, torch.Tensor]) -> Checkpoint:
    state = {k: v + deltas[k] if k in deltas else v for k, v in ckpt.state.items()}
    return Checkpoint(ckpt.cfg, state, "merged", None, "", (), ())


def test_several_adapters_in_one_batch(tmp_path: Path) -> None:
    base = load_dir(write_tiny_llama(tmp_path / "m"))
    deltas = {i: write_adapter(tmp_path / f"a{i}", base, seed=i) for i in (1, 2)}
    drv = make_driver(base, page_size=4, num_pages=32)
    for i in (1, 2):
        drv.adapter(Adapter(op="load", adapter_id=i, path=str(tmp_path / f"a{i}")))
    prompts = [random_tokens(n, 96, seed=n) for n in (7, 5, 9)]
    adapters = [1, -1, 2]
    specs = [
        request(p, 0, list(range(8 * r, 8 * r + 8)), 4, all_rows=True, adapter_id=a, context_id=r)
        for r, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    ]
    batch = drv.logits(forward(specs))
    rows = np.cumsum([0] + [len(p) for p in prompts])
    for r, a in enumerate(adapters):
        ckpt = base if a < 0 else _merged(base, deltas[a])
        alone = make_driver(ckpt, page_size=4, num_pages=8).logits(
            forward([request(prompts[r], 0, range(8), 4, all_rows=True)])
        )
        torch.testing.assert_close(batch[rows[r] : rows[r + 1]], alone, atol=1e-4, rtol=0)
    assert (
        batch[: rows[1]] - make_driver(base, 4, 8).logits(forward([request(prompts[0], 0, range(8), 4, all_rows=True)]))
    ).abs().max() > 1e-2
    drv.adapter(Adapter(op="unload", adapter_id=1))
    assert 1 not in drv.adapters


def test_copy_copies_pages(tmp_path: Path) -> None:
    drv = make_driver(load_dir(write_tiny_llama(tmp_path / "m")), page_size=4, num_pages=16)
    toks = random_tokens(10, 96, seed=1)
    drv.logits(forward([request(toks, 0, [0, 1, 2], 4)]))
    drv.copy(Copy(src_pages=np.array([0, 1, 2], np.uint32), dst_pages=np.array([9, 5, 7], np.uint32)))
    nxt = [toks[3]]
    a = drv.logits(forward([request(nxt, 10, [0, 1, 2], 4)]))
    b = drv.logits(forward([request(nxt, 10, [9, 5, 7], 4)]))
    c = drv.logits(forward([request(nxt, 10, [3, 4, 6], 4)]))  # pages never written
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (a - c).abs().max() > 1e-2
