"""What a driver accepts, taken from its `Handshake`; the decoder checks ranges against it."""

from __future__ import annotations

from dataclasses import dataclass

from bridge_schema.messages import Handshake


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    page_size: int
    num_pages: int
    max_context: int
    max_requests_per_pass: int
    max_tokens_per_pass: int
    max_mask_bytes: int
    max_probe_k: int

    @staticmethod
    def from_handshake(h: Handshake) -> Limits:
        return Limits(
            vocab_size=h.vocab_size,
            page_size=h.page_size,
            num_pages=h.num_pages,
            max_context=h.max_context,
            max_requests_per_pass=h.max_requests_per_pass,
            max_tokens_per_pass=h.max_tokens_per_pass,
            max_mask_bytes=h.max_mask_bytes,
            max_probe_k=h.max_probe_k,
        )
