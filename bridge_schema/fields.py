"""Wire types of message fields: how one field is encoded and strictly decoded.

Knows nothing about particular messages; `messages` declares fields with these types.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bridge_schema.errors import FieldError, RangeError

# Arrays up to this size are encoded as a copy (`tobytes`), larger ones as a view.
_COPY_BELOW_BYTES = 4096

_INT_RANGES = {
    "u8": (0, 2**8 - 1),
    "u32": (0, 2**32 - 1),
    "i32": (-(2**31), 2**31 - 1),
    "i64": (-(2**63), 2**63 - 1),
    "u64": (0, 2**64 - 1),
}


@dataclass(frozen=True, slots=True)
class Wire:
    """How a field travels: a scalar kind, or a little-endian numpy array of `dtype`."""

    kind: str  # "int" | "float" | "str" | "strs" | "stats" | "array"
    dtype: str = ""  # numpy dtype for arrays, e.g. "<u4"
    int_range: str = "i64"  # for kind == "int"
    logprobs: bool = False  # float arrays of log-probabilities may hold -inf (never NaN or +inf)
    range_checked: bool = False  # float array whose range check (in `checks`) also rejects NaN/inf


def array_field(dtype: str, logprobs: bool = False, range_checked: bool = False) -> Any:
    """A numpy array field, empty by default (optional features are empty arrays)."""
    np_dtype = np.dtype(dtype)
    return dataclasses.field(
        default_factory=lambda: np.zeros(0, dtype=np_dtype),
        metadata={"wire": Wire("array", dtype, logprobs=logprobs, range_checked=range_checked)},
    )


def scalar_field(kind: str, default: Any = dataclasses.MISSING, int_range: str = "i64") -> Any:
    wire = Wire(kind, int_range=int_range)
    if kind in ("strs", "stats"):
        factory = list if kind == "strs" else dict
        return dataclasses.field(default_factory=factory, metadata={"wire": wire})
    return dataclasses.field(default=default, metadata={"wire": wire})


def field_encoder(wire: Wire) -> Callable[[Any], Any]:
    """A function encoding one field, built once per field (the encoder's hot path)."""
    kind = wire.kind
    if kind == "array":
        dtype = np.dtype(wire.dtype)

        def array(value: Any) -> bytes | memoryview:
            # The little-endian bytes, C order. Small arrays (a decode pass's) are copied out
            # with `tobytes`, cheaper than a memoryview and its cast; large ones (a prefill's
            # tokens) go to msgpack as a view, which copies them once.
            arr = np.asarray(value, dtype=dtype)
            if arr.nbytes <= _COPY_BELOW_BYTES:
                return arr.tobytes()
            return np.ascontiguousarray(arr).data.cast("B")

        return array
    if kind == "float":
        return float
    if kind == "int":
        return int
    if kind == "strs":
        return list
    if kind == "stats":
        return dict
    return lambda value: value


def field_decoder(wire: Wire, name: str) -> Callable[[Any], Any]:
    """A function decoding one field strictly, built once per field (the decoder's hot path)."""
    kind = wire.kind
    if kind == "array":
        dtype = np.dtype(wire.dtype)
        itemsize, is_float = dtype.itemsize, dtype.kind == "f" and not wire.range_checked
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False  # shared by every message where this field is empty

        def array(raw: Any) -> Any:
            if type(raw) is not bytes:
                raise FieldError(f"expected binary array of {wire.dtype}, got {type(raw).__name__}", name)
            if not raw:
                return empty
            if len(raw) % itemsize:
                raise FieldError(f"{len(raw)} bytes is not a whole number of {wire.dtype} items", name)
            arr = np.frombuffer(raw, dtype=dtype)
            if is_float and arr.size and np.count_nonzero(np.isfinite(arr)) != arr.size:
                if not wire.logprobs:
                    raise RangeError("contains NaN or infinity", name)
                if np.isnan(arr).any() or (arr == np.inf).any():
                    raise RangeError("log-probabilities are finite or -inf", name)
            return arr

        return array
    if kind == "int":
        lo, hi = _INT_RANGES[wire.int_range]

        def integer(raw: Any) -> Any:
            if type(raw) is not int:
                raise FieldError(f"expected integer, got {type(raw).__name__}", name)
            if not lo <= raw <= hi:
                raise RangeError(f"{raw} outside {wire.int_range} range", name)
            return raw

        return integer
    return lambda raw: _decode_other(kind, name, raw)


def _decode_other(kind: str, name: str, raw: Any) -> Any:
    if kind == "float":
        if type(raw) is not float:
            raise FieldError(f"expected float, got {type(raw).__name__}", name)
        if not math.isfinite(raw):
            raise RangeError("must be finite", name)
        return raw
    if kind == "str":
        if not isinstance(raw, str):
            raise FieldError(f"expected string, got {type(raw).__name__}", name)
        return raw
    if kind == "strs":
        if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
            raise FieldError("expected a list of strings", name)
        return raw
    if kind == "stats":
        if not isinstance(raw, dict) or not all(
            isinstance(k, str) and type(v) in (int, float, str) for k, v in raw.items()
        ):
            raise FieldError("expected a map of string to int, float or string", name)
        return raw
    raise AssertionError(f"unknown wire kind {kind}")
