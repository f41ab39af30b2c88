"""Keep grammar-constrained output valid UTF-8: xgrammar's character classes accept the 3-byte
encodings of UTF-16 surrogates (ED A0 80 .. ED BF BF), which are not UTF-8. Decoded, each such
"character" becomes three U+FFFD, so a string the grammar bounded to N characters could come out
longer than N (and carry replacement characters the model never meant).

Per tokenizer, two masks over the vocabulary: tokens whose bytes contain a surrogate encoding
(never allowed), and tokens whose first byte is A0..BF (not allowed right after a token that
ended with a dangling ED lead byte). Pure numpy; the matcher applies them on top of the grammar's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_LEAD = 0xED


@dataclass(frozen=True, slots=True)
class Utf8Guard:
    allowed: npt.NDArray[np.uint32]  # bitmask words: every token but those with a surrogate inside
    allowed_after_lead: npt.NDArray[np.uint32]  # ... and but those that would complete one
    ends_with_lead: npt.NDArray[np.bool_]  # per token: its last byte is a dangling ED
    is_noop: bool  # no token is ever refused when nothing dangles (the first mask allows all)
    has_surrogate: npt.NDArray[np.bool_]  # per token: a surrogate encoding inside it
    completes_one: npt.NDArray[np.bool_]  # per token: it starts with A0..BF

    @classmethod
    def from_table(cls, table: Sequence[bytes]) -> Utf8Guard:
        """`table`: the bytes of each token id (b"" for control and unused ids)."""
        n = len(table)
        inside = np.fromiter((bool(_SURROGATE.search(t)) for t in table), dtype=np.bool_, count=n)
        completes = np.fromiter((bool(t) and 0xA0 <= t[0] <= 0xBF for t in table), dtype=np.bool_, count=n)
        ends = np.fromiter((bool(t) and t[-1] == _LEAD for t in table), dtype=np.bool_, count=n)
        allowed, allowed_after_lead = _allow_words(~inside), _allow_words(~(inside | completes))
        return cls(allowed, allowed_after_lead, ends, not inside.any(), inside, completes)

    def refuses(self, token_id: int, after_lead: bool) -> bool:
        """Whether `token_id` would put a surrogate into the output here."""
        return bool(self.has_surrogate[token_id]) or (after_lead and bool(self.completes_one[token_id]))

    def apply(self, words: npt.NDArray[np.uint32], after_lead: bool) -> bool:
        """AND the guard into a filled bitmask in place; True if that may have refused a token."""
        if after_lead:
            np.bitwise_and(words, self.allowed_after_lead, out=words)
            return True
        if self.is_noop:
            return False
        np.bitwise_and(words, self.allowed, out=words)
        return True


def _allow_words(allowed: npt.NDArray[np.bool_]) -> npt.NDArray[np.uint32]:
    """Bit j of word i set = token 32i+j allowed; bits past the vocabulary set (harmless)."""
    padded = np.ones((len(allowed) + 31) // 32 * 32, dtype=np.bool_)
    padded[: len(allowed)] = allowed
    return np.packbits(padded, bitorder="little").view("<u4").astype(np.uint32)
