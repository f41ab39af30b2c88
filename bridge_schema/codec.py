"""Encode messages to msgpack payloads and decode them strictly.

A payload is a msgpack map: "t" (type tag), "v" (protocol version) and every field of the
message, no more and no fewer. Arrays are little-endian binary, decoded zero-copy with
`numpy.frombuffer` (the arrays are read-only views of the payload). `decode` raises only
`SchemaError` subclasses, whatever the input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgpack

from bridge_schema.checks import CHECKS
from bridge_schema.errors import FieldError, FrameError, UnknownMessage, VersionMismatch
from bridge_schema.fields import Wire, field_decoder, field_encoder
from bridge_schema.limits import Limits
from bridge_schema.messages import MESSAGE_TYPES, Message
from bridge_schema.version import PROTOCOL_VERSION

_FIELDS: dict[type[Message], tuple[tuple[str, Wire], ...]] = {
    cls: tuple((f.name, f.metadata["wire"]) for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    for cls in MESSAGE_TYPES
}
_DECODERS: dict[type[Message], tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    cls: tuple((name, field_decoder(wire, f"{cls.TAG}.{name}")) for name, wire in fields)
    for cls, fields in _FIELDS.items()
}
_ENCODERS: dict[type[Message], tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    cls: tuple((name, field_encoder(wire)) for name, wire in fields) for cls, fields in _FIELDS.items()
}
_BY_TAG: dict[str, type[Message]] = {cls.TAG: cls for cls in MESSAGE_TYPES}
_RESERVED = ("t", "v")


def encode(message: Message) -> bytes:
    """The msgpack payload of `message` (no length prefix)."""
    cls = type(message)
    body: dict[str, Any] = {"t": cls.TAG, "v": PROTOCOL_VERSION}
    for name, encode_field in _ENCODERS[cls]:
        body[name] = encode_field(getattr(message, name))
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the bridge")


def unpack(payload: bytes) -> dict[str, Any]:
    """Parse a payload into its top-level map; `FrameError` for anything that is not one."""
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            timestamp=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, ...)
        raise FrameError(f"undecodable msgpack payload: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"payload is a {type(obj).__name__}, expected a map")
    return obj


def peek_id(payload: bytes) -> int:
    """Best-effort request id of a payload that failed to decode (0 when unknown)."""
    try:
        obj = unpack(payload)
    except FrameError:
        return 0
    rid = obj.get("id")
    return rid if type(rid) is int and 0 <= rid < 2**64 else 0


def decode(payload: bytes, limits: Limits | None = None) -> Message:
    """Decode and validate one payload. With `limits`, ranges are checked against them too."""
    return decode_map(unpack(payload), limits)


def decode_map(obj: dict[str, Any], limits: Limits | None = None) -> Message:
    tag = obj.get("t")
    if not isinstance(tag, str):
        raise FieldError("missing or not a string", "t")
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise UnknownMessage(f"unknown message type {tag!r}", "t")
    version = obj.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise VersionMismatch(f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}", "v")
    fields = _FIELDS[cls]
    if len(obj) != len(fields) + len(_RESERVED):
        known = {name for name, _ in fields}
        for key in obj:
            if key not in known and key not in _RESERVED:
                raise FieldError(f"unknown field in {tag!r}", f"{tag}.{key}")
    values = {}
    for name, decoder in _DECODERS[cls]:
        try:
            raw = obj[name]
        except KeyError:
            raise FieldError(f"missing field of {tag!r}", f"{tag}.{name}") from None
        values[name] = decoder(raw)
    message = cls(**values)
    check = CHECKS.get(cls)
    if check is not None:
        check(message, limits)
    return message
