"""Whatever bytes arrive, the decoder raises only `SchemaError` (or returns a valid message)."""

from __future__ import annotations

import random
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge_schema.codec import decode, encode, unpack
from bridge_schema.errors import SchemaError
from bridge_schema.messages import Forward, Message
from tests.bridge_schema.mutation import mutate
from tests.bridge_schema.samples import LIMITS, samples
from tests.bridge_schema.strategies import forward

PAYLOADS = [encode(m) for m in samples().values()]


def _decode_or_schema_error(payload: bytes) -> Message | None:
    try:
        return decode(payload, LIMITS)
    except SchemaError:
        return None


def test_12000_mutated_payloads_raise_only_schema_errors() -> None:
    rng = random.Random(20261129)
    rejected = 0
    for _ in range(12_000):
        rejected += _decode_or_schema_error(mutate(rng.choice(PAYLOADS), rng)) is None
    assert rejected > 6_000  # the mutations really break most frames


def test_2000_random_payloads_raise_only_schema_errors() -> None:
    rng = random.Random(7)
    for _ in range(2_000):
        _decode_or_schema_error(rng.randbytes(rng.randint(0, 200)))


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=1_500, deadline=None)
@given(st.sampled_from(sorted(samples())), st.data())
def test_field_replaced_by_any_value(name: str, data: st.DataObject) -> None:
    raw: dict[str, Any] = unpack(encode(samples()[name]))
    key = data.draw(st.sampled_from(sorted(raw)))
    if data.draw(st.booleans()):
        raw[key] = data.draw(_msgpack_values)
    else:
        del raw[key]
    _decode_or_schema_error(msgpack.packb(raw, use_bin_type=True))


@settings(max_examples=1_000, deadline=None)
@given(forward(), st.data())
def test_forward_array_replaced_by_random_bytes(message: Forward, data: st.DataObject) -> None:
    raw: dict[str, Any] = unpack(encode(message))
    arrays = sorted(k for k, v in raw.items() if isinstance(v, bytes))
    key = data.draw(st.sampled_from(arrays))
    raw[key] = data.draw(st.binary(max_size=64))
    _decode_or_schema_error(msgpack.packb(raw, use_bin_type=True))
