"""Errors particular to the torch driver, under the shared `drivers.errors` root.

DriverError (drivers.errors)
├── RequestRejected     a request field is bad for this model or cache (reply names the field)
└── MaskShapeError      an attention mask does not cover exactly the keys it is applied to;
                        raised instead of broadcasting, truncating or dropping it (INTERNAL)
"""

from __future__ import annotations

from drivers.errors import DriverError


class MaskShapeError(DriverError):
    code = "mask_shape"
