"""Random valid messages survive encode -> decode unchanged, with range checks on."""

from __future__ import annotations

from hypothesis import given, settings

from bridge_schema.codec import decode, encode
from bridge_schema.messages import Message
from tests.bridge_schema.equality import assert_same
from tests.bridge_schema.samples import LIMITS
from tests.bridge_schema.strategies import any_message, forward


@settings(max_examples=400, deadline=None)
@given(any_message())
def test_round_trip_every_message_type(message: Message) -> None:
    assert_same(decode(encode(message)), message)


@settings(max_examples=300, deadline=None)
@given(forward())
def test_forward_round_trip_within_limits(message: Message) -> None:
    assert_same(decode(encode(message), LIMITS), message)
