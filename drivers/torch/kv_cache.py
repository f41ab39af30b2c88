"""Page memory: K and V for every layer, allocated once at the handshake, addressed by flat slot
(page * page_size + offset). The host assigns pages; this file never allocates on its own. One
spare slot past the pages (`spare_slot`) takes the writes of padding rows (CUDA graphs' buckets)."""

from __future__ import annotations

import math

import torch

from drivers.errors import RequestRejected
from drivers.torch.weights import weight_arena


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed page memory; on the CPU on transparent huge pages where the OS allows it, as the
    int8 weights: decode attention reads each key's row at its own place in the pages, and on
    4 KiB pages a long context's rows span more pages than the TLB holds."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer, _ = weight_arena.allocate(math.prod(shape) * dtype.itemsize)
    return buffer.view(dtype).view(shape)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.spare_slot = num_pages * page_size
        shape = (num_layers, num_pages * page_size + 1, num_kv_heads, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        # Each layer's pages as a view made once: a decode step hands 60 of them to the compiled
        # stack, and making them anew cost ~1.5 us each, every step. Writes go through them in place.
        self.k_layers = self.k.unbind(0)
        self.v_layers = self.v.unbind(0)

    @property
    def size_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, K, Hkv, D] at flat cache `index` [B, K]."""
        b, n = index.shape
        flat = index.reshape(-1)
        k = self.k[layer].index_select(0, flat).view(b, n, *self.k.shape[2:])
        v = self.v[layer].index_select(0, flat).view(b, n, *self.v.shape[2:])
        return k, v

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages src[i] -> dst[i] in every layer."""
        if len(src) != len(dst):
            raise RequestRejected("src_pages and dst_pages differ in length", "dst_pages")
        for name, pages in (("src_pages", src), ("dst_pages", dst)):
            if any(p < 0 or p >= self.num_pages for p in pages):
                raise RequestRejected(f"page id >= num_pages {self.num_pages}", name)
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise RequestRejected("destinations must be distinct and not sources", "dst_pages")
        if not src:
            return
        ps = self.page_size
        offs = torch.arange(ps, device=self.k.device)
        s = (torch.tensor(src, device=self.k.device)[:, None] * ps + offs).reshape(-1)
        d = (torch.tensor(dst, device=self.k.device)[:, None] * ps + offs).reshape(-1)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]
