"""Each contract violation raises one `SchemaError` subclass naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward
from bridge_schema.codec import decode, encode, unpack
from bridge_schema.errors import (
    FieldError,
    FrameError,
    RangeError,
    SchemaError,
    ShapeError,
    UnknownMessage,
    VersionMismatch,
)
from bridge_schema.framing import frame, payload_length
from bridge_schema.messages import Copy, Forward
from tests.bridge_schema.samples import LIMITS, sample_forward, sample_multi_step_forward


def _raw(message: Any) -> dict[str, Any]:
    return unpack(encode(message))


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _with(**changes: Any) -> Forward:
    f = sample_forward()
    assert isinstance(f, Forward)
    return dataclasses.replace(f, **changes)


def _expect(exc: type[SchemaError], field: str, message: Any) -> None:
    with pytest.raises(exc) as info:
        decode(encode(message), LIMITS)
    assert info.value.field.endswith(field), info.value


def test_unknown_message_type() -> None:
    raw = _raw(sample_forward())
    raw["t"] = "teleport"
    with pytest.raises(UnknownMessage, match="teleport"):
        decode(_pack(raw))


def test_wrong_version() -> None:
    raw = _raw(sample_forward())
    raw["v"] = 999
    with pytest.raises(VersionMismatch, match="999"):
        decode(_pack(raw))


def test_missing_field_is_named() -> None:
    raw = _raw(sample_forward())
    del raw["positions"]
    with pytest.raises(FieldError) as info:
        decode(_pack(raw))
    assert info.value.field == "forward.positions"


def test_unknown_field_is_named() -> None:
    raw = _raw(sample_forward())
    raw["turbo"] = 1
    with pytest.raises(FieldError, match="turbo"):
        decode(_pack(raw))


def test_mistyped_field_is_named() -> None:
    raw = _raw(sample_forward())
    raw["tokens"] = [1, 2, 3]  # a msgpack list, not a binary array
    with pytest.raises(FieldError) as info:
        decode(_pack(raw))
    assert info.value.field == "forward.tokens"


def test_array_with_partial_item() -> None:
    raw = _raw(sample_forward())
    raw["tokens"] = b"\x01\x02\x03"
    with pytest.raises(FieldError, match="whole number"):
        decode(_pack(raw))


def test_indptr_not_monotone() -> None:
    _expect(ShapeError, "token_indptr", _with(token_indptr=np.array([0, 5, 4, 7], np.uint32)))


def test_indptr_does_not_match_data() -> None:
    _expect(ShapeError, "token_indptr", _with(token_indptr=np.array([0, 5, 8], np.uint32)))


def test_page_out_of_range() -> None:
    _expect(RangeError, "pages", _with(pages=np.array([5, 6, 1, 2, 3, 64], np.uint32)))


def test_token_out_of_range() -> None:
    _expect(RangeError, "tokens", _with(tokens=np.array([10, 11, 12, 13, 14, 20, 260, 0], np.uint32)))


def test_too_few_kv_slots_for_tokens() -> None:
    _expect(
        ShapeError,
        "pages",
        _with(
            last_page_len=np.array([1, 1, 1], np.uint32),
            page_indptr=np.array([0, 1, 4, 5], np.uint32),
            pages=np.array([5, 1, 2, 3, 7], np.uint32),
        ),
    )


def test_mask_row_shorter_than_keys() -> None:
    _expect(ShapeError, "mask_runs", _with(mask_runs=np.array([0, 9, 2, 8], np.uint32)))


def test_mask_rows_must_cover_every_token() -> None:
    _expect(
        ShapeError,
        "mask_req_indptr",
        _with(
            mask_req_indptr=np.array([0, 0, 1], np.uint32),
            mask_row_indptr=np.array([0, 2], np.uint32),
            mask_runs=np.array([0, 10], np.uint32),
        ),
    )


def test_output_row_past_tokens() -> None:
    _expect(RangeError, "out_rows", _with(out_rows=np.array([5, 0, 1], np.uint32)))


def test_random_sampler_needs_positive_temperature() -> None:
    _expect(RangeError, "temperature", _with(temperature=np.array([0.0, 1.0, 1.0], np.float32)))


def test_nan_is_rejected() -> None:
    _expect(RangeError, "top_p", _with(top_p=np.array([np.nan, 1.0, 1.0], np.float32)))


def test_logit_mask_index_past_masks() -> None:
    _expect(RangeError, "logit_mask_index", _with(logit_mask_index=np.array([-1, 1, 0], np.int32)))


def test_deferred_request_indices_are_checked() -> None:
    _expect(RangeError, "deferred", _with(deferred=np.array([3], np.uint32)))
    _expect(ShapeError, "deferred", _with(deferred=np.array([2, 2], np.uint32)))
    _expect(RangeError, "tokens", _with(deferred=np.array([0, 2], np.uint32)))  # token 10 is not 0


def test_score_tokens_are_one_per_output_or_none() -> None:
    _expect(ShapeError, "score_tokens", _with(score_tokens=np.array([1, 2], np.int32)))  # 3 outputs
    _expect(RangeError, "score_tokens", _with(score_tokens=np.array([-2, -1, -1], np.int32)))
    _expect(RangeError, "score_tokens", _with(score_tokens=np.array([-1, 5000, -1], np.int32)))  # vocab 260
    decode(encode(_with(score_tokens=np.array([-1, 7, -1], np.int32))), LIMITS)  # valid


def _steps(**changes: Any) -> Forward:
    return dataclasses.replace(sample_multi_step_forward(), **changes)


def test_multi_step_requests_are_checked() -> None:
    decode(encode(sample_multi_step_forward()), LIMITS)  # the valid one
    _expect(ShapeError, "steps", _steps(steps=np.array([1, 3], np.uint32)))
    _expect(RangeError, "steps", _steps(steps=np.array([1, 0, 1], np.uint32)))
    _expect(RangeError, "steps", _steps(steps=np.array([1, 65, 1], np.uint32)))
    _expect(ShapeError, "steps", _steps(steps=np.array([3, 3, 1], np.uint32)))  # two input tokens
    _expect(ShapeError, "out_indptr", _steps(steps=np.array([1, 2, 1], np.uint32)))  # 3 outputs, 2 steps
    _expect(ShapeError, "probe", _steps(probe=np.array([0, 1, 0, 0], np.uint8)))
    _expect(ShapeError, "logit_mask_index", _steps(logit_mask_index=np.array([-1, -1, 0, -1], np.int32)))
    # Rows 0..steps-1 of a multi-step request; 3 steps need 3 KV slots.
    _expect(RangeError, "out_rows", _steps(out_rows=np.array([0, 0, 1, 3], np.uint32)))
    _expect(ShapeError, "pages", sample_multi_step_forward(pages=(1,), last_page_len=2))


def test_too_many_requests_for_the_driver() -> None:
    specs = [RequestSpec(i, [1], [0], [i], 1, [OutputSpec(0, Sampler.greedy())]) for i in range(17)]
    _expect(RangeError, "context_ids", build_forward(1, specs))


def test_copy_with_overlapping_pages() -> None:
    with pytest.raises(ShapeError, match="also a source"):
        decode(encode(Copy(src_pages=np.array([1, 2], np.uint32), dst_pages=np.array([2, 3], np.uint32))))


def test_oversized_frame_is_rejected_by_its_header() -> None:
    with pytest.raises(FrameError, match="exceeds"):
        payload_length(frame(b"x" * 100)[:4], max_frame_bytes=99)
    with pytest.raises(FrameError):
        frame(b"x" * 100, max_frame_bytes=99)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x92\x01\x02", b"\x81\xa1t\xa5hello\x00", b"\xd4\x01\x00"])
def test_garbage_payloads(payload: bytes) -> None:
    with pytest.raises(SchemaError):
        decode(payload)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_sampler_floats_reject_nan_and_infinity(field: str, bad: float) -> None:
    values = np.array([0.5, 0.5, 0.5], np.float32)
    values[0] = bad
    _expect(RangeError, field, _with(**{field: values}))


_F32_MAX = float(np.finfo(np.float32).max)
_TINY = float(np.nextafter(np.float32(0), np.float32(1)))
_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("temperature", _F32_MAX, True),
        ("temperature", _TINY, True),
        ("temperature", -_TINY, False),
        ("top_p", 1.0, True),
        ("top_p", _TINY, True),
        ("top_p", 0.0, False),
        ("top_p", 1.0000001, False),
        ("min_p", 0.0, True),
        ("min_p", _BELOW_ONE, True),
        ("min_p", 1.0, False),
        ("min_p", -_TINY, False),
    ],
)
def test_sampler_float_bounds_on_the_random_row(field: str, value: float, valid: bool) -> None:
    """The edges of each sampler float's range, on the row that samples at random (row 0)."""
    values = getattr(sample_forward(), field).copy()
    values[0] = value
    message = _with(**{field: values})
    if valid:
        decode(encode(message), LIMITS)
    else:
        _expect(RangeError, field, message)


def test_temperature_zero_is_valid_on_greedy_rows_only() -> None:
    f = _with(temperature=np.zeros(3, np.float32))  # row 0 samples at random
    _expect(RangeError, "temperature", f)
    greedy = dataclasses.replace(f, sampler=np.zeros(3, np.uint8))
    decode(encode(greedy), LIMITS)
