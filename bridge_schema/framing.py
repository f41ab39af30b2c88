"""Length-prefixed frames: a little-endian u32 payload length, then the msgpack payload."""

from __future__ import annotations

import struct

from bridge_schema.errors import FrameError

HEADER = struct.Struct("<I")
HEADER_BYTES = HEADER.size
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024


def check_length(length: int, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """`length`, or `FrameError` when a frame that long is over the maximum."""
    if length > max_frame_bytes:
        raise FrameError(f"frame of {length} bytes exceeds the maximum {max_frame_bytes}")
    return length


def frame(payload: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    return HEADER.pack(check_length(len(payload), max_frame_bytes)) + payload


def payload_length(header: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """The payload length announced by a header; `FrameError` when it is over the maximum."""
    (length,) = HEADER.unpack(header)
    return check_length(int(length), max_frame_bytes)
