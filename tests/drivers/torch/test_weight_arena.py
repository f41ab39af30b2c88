"""Packed int8 weights (`weight_arena.py`): one buffer, step order, 64-byte aligned starts, advised
onto huge pages where the OS allows it and plain pages where not; a packed model's logits equal an
unpacked one's bit for bit. The CPU KV cache's pages come from the same allocator."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from bridge_schema.messages import Hello
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.kv_cache import PagedKVCache
from drivers.torch.weights import weight_arena
from tests.drivers.torch.helpers import forward, load_dir, random_tokens, request, write_tiny_llama

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (64, 7), (1, 1), (9, 130)]
    return [torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for shape in shapes]


def _check_packed(tensors: list[torch.Tensor], views: list[torch.Tensor]) -> None:
    starts = [v.data_ptr() for v in views]
    assert all(torch.equal(t, v) and v.is_contiguous() for t, v in zip(tensors, views, strict=True))
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1, "one buffer"
    assert starts == sorted(starts) and all(s % weight_arena.ALIGN_BYTES == 0 for s in starts)
    for view, nxt in zip(views, starts[1:], strict=False):
        assert view.data_ptr() + view.numel() <= nxt < view.data_ptr() + view.numel() + weight_arena.ALIGN_BYTES


def test_pack_keeps_values_and_order_in_one_aligned_buffer() -> None:
    tensors = _tensors()
    views, _ = weight_arena.pack(tensors)
    _check_packed(tensors, views)


def test_without_madvise_packs_on_normal_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    tensors = _tensors()
    views, huge = weight_arena.pack(tensors)
    assert not huge
    _check_packed(tensors, views)


def _smaps_field(address: int, field: str) -> str:
    """`field` of the mapping of this process that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == f"{field}:":
            return line.split()[1]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="transparent huge pages are off here",
)
def test_buffer_is_advised_onto_huge_pages() -> None:
    buffer, huge = weight_arena.allocate(5 << 20)
    assert huge and buffer.data_ptr() % weight_arena.HUGE_PAGE_BYTES == 0
    assert _smaps_field(buffer.data_ptr(), "THPeligible") == "1"


@pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="transparent huge pages are off (or madvise is missing) here",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_pages_are_advised_onto_huge_pages(dtype: torch.dtype) -> None:
    """The CPU KV cache is page memory like the weights: zeroed, of its dtype and shape, on a
    THP-eligible mapping (decode attention reads a long context's rows across many pages)."""
    cache = PagedKVCache(3, 40, 16, 2, 64, dtype, torch.device("cpu"))
    for pages in (cache.k, cache.v):
        assert pages.dtype == dtype and pages.shape == (3, 40 * 16 + 1, 2, 64) and pages.is_contiguous()
        assert not pages.any()
        assert _smaps_field(pages.data_ptr(), "THPeligible") == "1"
    cache.k_layers[1][5] = 1.0  # the per-layer views write the pages in place
    assert cache.k[1, 5].eq(1.0).all() and int(cache.k.ne(0).sum()) == 2 * 64


@pytest.mark.parametrize(("weights", "dtype"), [("w8a8", "float32"), ("int8", "bfloat16")])
def test_packed_model_equals_unpacked(tmp_path: Path, weights: str, dtype: str) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    packed, plain = (
        TorchDriver(ckpt, DriverOptions(weights=weights, dtype=dtype, num_pages=8, pack_weights=on))
        for on in (True, False)
    )
    blocks, head = packed.model.model.blocks(), packed.model.output_head
    order = [m for b in blocks for m in (b.self_attn.qkv, b.self_attn.o_proj, b.mlp.gate_up, b.mlp.down_proj)]
    views = [m.weight_int8 for m in [*order, head]]
    starts = [v.data_ptr() for v in views]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1 and starts == sorted(starts), "step order"
    unpacked = {m.weight_int8.untyped_storage().data_ptr() for m in plain.model.modules() if hasattr(m, "weight_int8")}
    assert len(unpacked) > 1
    if weights == "w8a8":  # the kernel reads one tensor a linear: its panels, then scales, then sums
        for m in [*order, head]:
            start, size = m.packed.data_ptr(), m.weight_int8.numel()
            assert m.weight_int8.data_ptr() == start and m.scale.data_ptr() == start + size
            assert m.weight_sum.data_ptr() == start + size + 4 * m.out_features
            assert m.packed.numel() == size + 8 * m.out_features
    prompt = random_tokens(13, 96, seed=4)
    for drv in (packed, plain):
        drv.handshake(Hello())
    got, want = (d.logits(forward([request(prompt, 0, range(8), 16, all_rows=True)])) for d in (packed, plain))
    assert torch.equal(got, want)
