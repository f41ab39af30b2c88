"""SSE framing: a template frame is byte for byte the frame of the whole object."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from host.daemon.http_util import SseTemplate, sse


def chunk(text: str) -> dict[str, object]:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice], "usage": None}


@given(st.text())
def test_a_template_frame_equals_the_frame_of_the_object(text: str) -> None:
    assert SseTemplate(chunk(SseTemplate.SLOT)).frame(text) == sse(chunk(text))


@pytest.mark.parametrize("text", ['"', "\\", "\n", "\x00", "é ü 漢字 🙂", "\u2028", SseTemplate.SLOT, ""])
def test_a_template_frame_escapes_what_json_escapes(text: str) -> None:
    assert SseTemplate(chunk(SseTemplate.SLOT)).frame(text) == sse(chunk(text))


def test_a_template_holds_its_slot_exactly_once() -> None:
    with pytest.raises(ValueError):
        SseTemplate(chunk("no slot"))
    with pytest.raises(ValueError):
        SseTemplate({"a": SseTemplate.SLOT, "b": SseTemplate.SLOT})
