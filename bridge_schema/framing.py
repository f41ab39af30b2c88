"""Length-prefixed frames: a little-endian u32 payload length, then the msgpack payload."""

from __future__ import annotations

import struct

from bridge_schema.errors import FrameError

HEADER = struct.Struct("<I")
HEADER_BYTES = HEADER.size
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024


def frame(payload: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    if len(payload) > max_frame_bytes:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the maximum {max_frame_bytes}")
    return HEADER.pack(len(payload)) + payload


def payload_length(header: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """The payload length announced by a header; `FrameError` when it is over the maximum."""
    (length,) = HEADER.unpack(header)
    if length > max_frame_bytes:
        raise FrameError(f"frame of {length} bytes exceeds the maximum {max_frame_bytes}")
    return int(length)
