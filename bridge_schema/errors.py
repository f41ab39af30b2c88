"""Errors of the bridge contract.

    BridgeError                 root of everything this package raises
    ├── SchemaError             a frame or message violates the contract (decoder output)
    │   ├── FrameError          framing: bad length prefix, oversized frame, undecodable msgpack
    │   ├── UnknownMessage      the type tag names no message
    │   ├── VersionMismatch     the schema version is not ours
    │   ├── FieldError          a field is missing, unknown or of the wrong type
    │   ├── ShapeError          CSR arrays disagree (indptr not monotone, lengths mismatch)
    │   └── RangeError          a value is out of range (page index, token id, sampler param)
    ├── TransportError          the connection failed or closed
    │   └── ConnectionClosed
    ├── RemoteError             the peer replied with an `ErrorReply`
    └── ConfigError             a configuration breaks a rule both sides enforce (config_rules)

Every `SchemaError` carries the dotted name of the offending field (or "" for frame-level errors)
so a driver can put it into its error reply.
"""

from __future__ import annotations


class BridgeError(Exception):
    """Root of every error raised by `bridge_schema`."""


class SchemaError(BridgeError):
    """A frame or message that violates the bridge contract."""

    code = "schema"

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.detail = message


class FrameError(SchemaError):
    code = "frame"


class UnknownMessage(SchemaError):
    code = "unknown_message"


class VersionMismatch(SchemaError):
    code = "version"


class FieldError(SchemaError):
    code = "field"


class ShapeError(SchemaError):
    code = "shape"


class RangeError(SchemaError):
    code = "range"


class TransportError(BridgeError):
    """The connection to the peer failed or was closed."""


class ConnectionClosed(TransportError):
    """The peer closed the connection (cleanly, at a frame boundary, or mid-frame)."""


class RemoteError(BridgeError):
    """The peer answered a request with an `ErrorReply`."""

    def __init__(self, status: int, code: str, field: str, message: str) -> None:
        where = f" (field {field})" if field else ""
        super().__init__(f"driver error {code or status}{where}: {message}")
        self.status = status
        self.code = code
        self.field = field
        self.detail = message


class ConfigError(BridgeError):
    """A configuration violates a rule both sides of the bridge enforce."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.detail = message
