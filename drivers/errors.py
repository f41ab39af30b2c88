"""Errors a driver raises while handling a valid frame; the serve loop turns them into replies.

DriverError            root: `status` and `field` travel in the `ErrorReply`
├── RequestRejected    the request is well-formed but this driver cannot take it (OUT_OF_RANGE)
├── Unsupported        a capability this driver lacks (UNSUPPORTED)
└── ConfigRejected     the `Hello` asks for a configuration the driver refuses (BAD_REQUEST)
"""

from __future__ import annotations

from bridge_schema.messages import Status


class DriverError(Exception):
    status: Status = Status.INTERNAL
    code = "driver"

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.detail = message


class RequestRejected(DriverError):
    status = Status.OUT_OF_RANGE
    code = "rejected"


class Unsupported(DriverError):
    status = Status.UNSUPPORTED
    code = "unsupported"


class ConfigRejected(DriverError):
    status = Status.BAD_REQUEST
    code = "config"
