"""`host.app_bundle`: an inferlet's sources ride in a custom section of the base component, the
section comes off byte-exact, and a malformed one is refused saying what is wrong."""

from __future__ import annotations

import json

import pytest

from host.app_bundle import SECTION_NAME, AppSources, BundleError, _leb128, append_sources, split_sources

# The smallest component: the preamble, then one custom section ("x", empty).
BASE = b"\0asm\x0d\x00\x01\x00" + bytes([0, 2, 1]) + b"x"
FILES = (("app.py", "def main(args):\n    pass\n"), ("pkg/__init__.py", "# ünïcode\n"))


def test_sources_round_trip_and_the_base_comes_back_byte_exact() -> None:
    bundled = append_sources(BASE, AppSources("abc123", FILES))
    base, sources = split_sources(bundled)
    assert base == BASE
    assert sources == AppSources("abc123", FILES)


def test_a_component_without_sources_is_returned_as_is() -> None:
    assert split_sources(BASE) == (BASE, None)


def test_bytes_that_are_no_component_are_left_for_wasmtime_to_judge() -> None:
    for junk in (b"not wasm", b"\0asm\x01\0\0\0 not really", b"\0asm\x0d\x00\x01\x00\x00\xff\xff"):
        assert split_sources(junk) == (junk, None)


def _section(payload: bytes) -> bytes:
    name = SECTION_NAME.encode()
    body = _leb128(len(name)) + name + payload
    return BASE + bytes([0]) + _leb128(len(body)) + body


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"{not json", "is not JSON"),
        (json.dumps({SECTION_NAME: 99, "base": "x", "files": []}).encode(), "is not format 1"),
        (json.dumps({SECTION_NAME: 1, "base": 3, "files": []}).encode(), "needs a string 'base'"),
        (json.dumps({SECTION_NAME: 1, "base": "x", "files": [["app.py"]]}).encode(), r"\[path, text\] pairs"),
        (json.dumps({SECTION_NAME: 1, "base": "x", "files": [["lib.py", ""]]}).encode(), "has no app.py"),
    ],
)
def test_a_malformed_section_is_refused_saying_why(payload: bytes, says: str) -> None:
    with pytest.raises(BundleError, match=says):
        split_sources(_section(payload))


def test_a_section_nested_past_the_parser_s_depth_is_refused_not_crashed_on() -> None:
    with pytest.raises(BundleError, match="nests its JSON too deeply"):
        split_sources(_section(b"[" * 200_000))


def test_section_lengths_past_one_byte_are_encoded() -> None:
    big = (("app.py", "x = 1\n" * 5000),)
    assert split_sources(append_sources(BASE, AppSources("d", big)))[1] == AppSources("d", big)
