"""Golden bytes: the wire encoding of every message type is pinned. A change to a message or
its encoding must bump PROTOCOL_VERSION and regenerate golden.json deliberately."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bridge_schema.codec import decode, encode
from bridge_schema.messages import MESSAGE_TYPES
from tests.bridge_schema.equality import assert_same
from tests.bridge_schema.samples import LIMITS, samples

GOLDEN = json.loads((Path(__file__).parent / "golden.json").read_text())


def test_every_message_type_has_a_golden_sample() -> None:
    assert {cls.TAG for cls in MESSAGE_TYPES} == set(GOLDEN) == set(samples())


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_encode_matches_golden_bytes(name: str) -> None:
    assert encode(samples()[name]).hex() == GOLDEN[name]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_decode_golden_bytes(name: str) -> None:
    decoded = decode(bytes.fromhex(GOLDEN[name]), LIMITS if name == "forward" else None)
    assert_same(decoded, samples()[name])


def test_arrays_decode_zero_copy() -> None:
    payload = bytes.fromhex(GOLDEN["forward"])
    tokens = decode(payload).tokens  # type: ignore[attr-defined]
    assert isinstance(tokens, np.ndarray)
    assert not tokens.flags.owndata and not tokens.flags.writeable
    assert tokens.base is not None
