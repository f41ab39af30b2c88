"""The host<->driver contract, defined once: messages, codec, framing, transports, errors.

Imports only the standard library, msgpack, numpy (zero-copy arrays) and anyio (transports).
"""

from bridge_schema.errors import BridgeError, SchemaError
from bridge_schema.version import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "BridgeError", "SchemaError"]
