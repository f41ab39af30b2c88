"""The engine side of prefix reuse: each context's slot history, reuse of cached pages when a
pass starts a context, and naming of pages as passes complete. Called with the engine's lock held.

Pages written by a pass with a custom attention mask are never named: their KV depends on the
mask, which the name does not cover. A pass keeps at least its last token (and every output row)
to compute, so a prompt that is an exact multiple of the page size still gets its logits without
writing into a shared page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from host.engine.pages import PageTable
from host.engine.passes import Pass
from host.engine.prefix_cache import ROOT, PrefixCache, page_key, page_keys

_Ids = Sequence[int] | npt.NDArray[np.uint32]


@dataclass(slots=True)
class _History:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    adapters: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # names of the full pages registered so far
    is_masked: bool = False  # a masked pass ran: stop naming this context's pages


class PrefixReuse:
    def __init__(self, pages: PageTable, cache: PrefixCache) -> None:
        self._pages = pages
        self.cache = cache
        self._page_size = pages.page_size
        self._history: dict[int, _History] = {}

    # ------------------------------------------------------------------ context lifecycle

    def on_create(self, context_id: int) -> None:
        self._history[context_id] = _History()

    def on_fork(self, src: int, dst: int) -> None:
        h = self._history[src]
        self._history[dst] = _History(list(h.tokens), list(h.positions), list(h.adapters), list(h.keys), h.is_masked)

    def on_truncate(self, context_id: int, length: int) -> None:
        h = self._history[context_id]
        del h.tokens[length:], h.positions[length:], h.adapters[length:]
        del h.keys[length // self._page_size :]

    def on_release_pages(self, context_id: int) -> None:
        """Pages were released from the context's middle: name none of its pages from now on."""
        self._history[context_id].is_masked = True

    def on_release(self, context_id: int) -> None:
        self._history.pop(context_id, None)

    # ------------------------------------------------------------------ passes

    def reuse(self, context_id: int, checked: Pass) -> tuple[int, Pass]:
        """For a pass that starts an empty context: adopt the longest chain of cached pages its
        tokens name, and return (tokens reused, the pass left to compute)."""
        ps = self._page_size
        num = len(checked.tokens)
        if self._pages.length(context_id) or checked.mask_rows is not None or num <= ps:
            return 0, checked
        first_output = checked.outputs[0].row if checked.outputs else num - 1
        max_pages = min(first_output, num - 1) // ps
        self.cache.tokens_queried += max_pages * ps
        tokens, positions = checked.tokens.tolist(), checked.positions.tolist()
        keys = page_keys(
            tokens[: max_pages * ps], positions[: max_pages * ps], [checked.adapter_id] * (max_pages * ps), ps
        )
        cached = self.cache.lookup(keys)
        if not cached:
            return 0, checked
        reused = len(cached) * ps
        self._pages.adopt(context_id, cached)
        self._history[context_id].keys.extend(keys[: len(cached)])
        self.cache.hits += 1
        self.cache.tokens_reused += reused
        rest = replace(
            checked,
            tokens=checked.tokens[reused:],
            positions=checked.positions[reused:],
            outputs=tuple(replace(o, row=o.row - reused) for o in checked.outputs),
        )
        return reused, rest

    def record(self, context_id: int, tokens: _Ids, positions: _Ids, adapter_id: int, masked: bool) -> None:
        """Slots a pass adds to the context (at submission, or when a staged pass is served)."""
        h = self._history[context_id]
        h.tokens.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
        h.positions.extend(positions.tolist() if isinstance(positions, np.ndarray) else positions)
        h.adapters.extend([adapter_id] * len(tokens))
        h.is_masked = h.is_masked or masked

    def register_completed(self, context_id: int, end: int) -> None:
        """Name the context's full pages whose KV is now computed (slots below `end`)."""
        h = self._history.get(context_id)
        if h is None or h.is_masked:
            return
        ps = self._page_size
        end = min(end, len(h.tokens), self._pages.length(context_id))
        while (len(h.keys) + 1) * ps <= end:
            i = len(h.keys)
            start, stop = i * ps, (i + 1) * ps
            key = page_key(
                h.keys[-1] if h.keys else ROOT, h.tokens[start:stop], h.positions[start:stop], h.adapters[start:stop]
            )
            h.keys.append(key)
            self._pages.register(context_id, i, key)

    def stats(self) -> dict[str, int]:
        c = self.cache
        return {
            "prefix_hits": c.hits,
            "prefix_tokens_reused": c.tokens_reused,
            "prefix_tokens_queried": c.tokens_queried,
            "prefix_evictions": c.evictions,
            "prefix_cached_pages": len(c),
        }


class NoPrefixReuse:
    """Prefix reuse turned off (`prefix_match_unit` 0): the same events, none doing anything, so
    the context lifecycle has one code path whether reuse is on or off."""

    def on_create(self, context_id: int) -> None:
        pass

    def on_fork(self, src: int, dst: int) -> None:
        pass

    def on_truncate(self, context_id: int, length: int) -> None:
        pass

    def on_release_pages(self, context_id: int) -> None:
        pass

    def on_release(self, context_id: int) -> None:
        pass

    def reuse(self, context_id: int, checked: Pass) -> tuple[int, Pass]:
        return 0, checked

    def record(self, context_id: int, tokens: _Ids, positions: _Ids, adapter_id: int, masked: bool) -> None:
        pass

    def register_completed(self, context_id: int, end: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}
