"""Prefix reuse at page granularity (pure): each full KV page is named by a hash chain over the
(token, position, adapter) of its slots and of every slot before it; a new prompt reuses the
longest chain of cached pages. Cached pages hold one reference of their own, so they outlive the
contexts that wrote them; unreferenced ones are evicted least-recently-used when pages run out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = b"wafer-prefix-v1"


def page_key(previous: bytes, tokens: Sequence[int], positions: Sequence[int], adapters: Sequence[int]) -> bytes:
    """The name of a full page given the name of the page before it (`ROOT` for the first)."""
    h = hashlib.blake2b(previous, digest_size=16)
    for t, p, a in zip(tokens, positions, adapters, strict=True):
        h.update(t.to_bytes(4, "little") + p.to_bytes(4, "little") + a.to_bytes(4, "little", signed=True))
    return h.digest()


def page_keys(
    tokens: Sequence[int], positions: Sequence[int], adapters: Sequence[int], page_size: int, previous: bytes = ROOT
) -> list[bytes]:
    """Names of every full page of a slot sequence that starts at a page boundary."""
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        stop = start + page_size
        previous = page_key(previous, tokens[start:stop], positions[start:stop], adapters[start:stop])
        keys.append(previous)
    return keys


@dataclass
class PrefixCache:
    """key <-> page, plus recency. The page table owns reference counts; this owns names."""

    _page_of: dict[bytes, int] = field(default_factory=dict)
    _key_of: dict[int, bytes] = field(default_factory=dict)
    _recency: OrderedDict[int, None] = field(default_factory=OrderedDict)  # least recent first
    hits: int = 0
    tokens_reused: int = 0
    tokens_queried: int = 0  # prompt tokens in whole pages looked up
    evictions: int = 0

    def __len__(self) -> int:
        return len(self._page_of)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `keys`, marked as recently used."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
            self._recency.move_to_end(page)
        return pages

    def insert(self, key: bytes, page: int) -> bool:
        """Name `page`; False (nothing changes) if the key or the page is already cached."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        self._recency[page] = None
        return True

    def by_recency(self) -> list[int]:
        """Cached pages, least recently used first."""
        return list(self._recency)

    def remove(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key]
        del self._recency[page]
