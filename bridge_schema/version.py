"""The protocol version. Any change to a message or a field's meaning bumps it."""

from __future__ import annotations

PROTOCOL_VERSION = 10
