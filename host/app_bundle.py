"""An inferlet as a shared base component plus its own sources, in one `.wasm` file.

`wafer build` compiles CPython, the SDK and a set of standard modules into a base component once
per SDK version (the slow part: componentize-py and a wasmtime compile), then writes each inferlet
as that base with the inferlet's Python files appended in a custom section named `wafer-app`.
A custom section is part of the component binary format and ignored by wasmtime, so the file is
still a valid component; the host strips the section before compiling, so every inferlet on the
same base shares one compiled copy, and an edit rebuilds nothing but this file.

At run time the base asks the host for the sources (`runtime.app-sources`) and imports `app`
from them. The section's payload is JSON: {"wafer-app": 1, "base": DIGEST, "files": [[PATH, TEXT], ...]}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

SECTION_NAME = "wafer-app"
FORMAT = 1
_PREAMBLE_LEN = 8  # "\0asm" + the component's version and layer
_CUSTOM_SECTION = 0


class BundleError(ValueError):
    """The file's `wafer-app` section is malformed; the message says how."""


@dataclass(frozen=True, slots=True, weakref_slot=True)
class AppSources:
    """An inferlet's own modules: (path relative to its folder, source text), `app.py` among them."""

    base_digest: str
    files: tuple[tuple[str, str], ...]


def _leb128(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_leb128(data: bytes | memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 35:
            raise BundleError("truncated or oversized section length")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def encode_payload(sources: AppSources) -> bytes:
    """The `wafer-app` section's payload for `sources` (what `decode_payload` reads back)."""
    return json.dumps(
        {SECTION_NAME: FORMAT, "base": sources.base_digest, "files": [list(f) for f in sources.files]},
        ensure_ascii=False,
    ).encode()


def append_sources(base: bytes, sources: AppSources) -> bytes:
    """The base component with the inferlet's sources in a trailing custom section."""
    payload = encode_payload(sources)
    name = SECTION_NAME.encode()
    body = _leb128(len(name)) + name + payload
    return base + bytes([_CUSTOM_SECTION]) + _leb128(len(body)) + body


def split_sources(data: bytes) -> tuple[bytes, AppSources | None]:
    """(the component without its `wafer-app` section, the sources in it, or None if it has none).
    Walks the top-level sections (a component has tens of them, however large its modules).
    Bytes that are no component come back unchanged, for wasmtime to say what is wrong."""
    view = memoryview(data)
    at = _PREAMBLE_LEN if data[:4] == b"\0asm" else len(data)
    while at < len(data):
        start = at
        section_id = data[at]
        try:
            size, body_at = _read_leb128(view, at + 1)
        except BundleError:
            return data, None
        end = body_at + size
        if end > len(data):
            return data, None
        if section_id == _CUSTOM_SECTION:
            name_len, name_at = _read_leb128(view, body_at)
            if bytes(view[name_at : name_at + name_len]) == SECTION_NAME.encode():
                sources = decode_payload(bytes(view[name_at + name_len : end]))
                return data[:start] + data[end:], sources
        at = end
    return data, None


def decode_payload(payload: bytes) -> AppSources:
    """The sources in a `wafer-app` section's payload; BundleError if it is malformed."""
    try:
        doc = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"the {SECTION_NAME} section is not JSON: {exc}") from None
    except RecursionError:  # JSON nested deeper than the parser's recursion limit
        raise BundleError(f"the {SECTION_NAME} section nests its JSON too deeply to read") from None
    if not isinstance(doc, dict) or doc.get(SECTION_NAME) != FORMAT:
        raise BundleError(f"the {SECTION_NAME} section is not format {FORMAT}")
    files = doc.get("files")
    base = doc.get("base")
    if not isinstance(base, str) or not isinstance(files, list):
        raise BundleError(f"the {SECTION_NAME} section needs a string 'base' and a list 'files'")
    out: list[tuple[str, str]] = []
    for entry in files:
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
            raise BundleError(f"the {SECTION_NAME} section's files must be [path, text] pairs")
        out.append((entry[0], entry[1]))
    if not any(path == "app.py" for path, _ in out):
        raise BundleError(f"the {SECTION_NAME} section has no app.py")
    return AppSources(base, tuple(out))
