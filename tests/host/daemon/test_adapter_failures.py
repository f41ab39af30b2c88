"""A driver killed in the middle of a Responses or Messages stream: the status line is long gone,
so the stream ends with the API's own failure event (`response.failed`; Anthropic's `error`
event in its envelope), which the real clients read; the driver comes back."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from typing import Any

import anthropic
import pytest

from tests.host.daemon.conftest import API_KEY, Server
from tests.host.daemon.test_messages import anthropic_error
from tests.host.daemon.test_supervision import _num_generating

ASK: Any = [{"role": "user", "content": "Tell a long story."}]
# ignore_eos: no stop token ends the generation before the kill.
LONG: Any = {"ignore_eos": True}


def _read_killing_the_driver(server: Server, events: Iterable[Any]) -> list[Any]:
    """The events, with the driver killed once the run generates."""
    health = server.wait_ready()
    driver = health["driver"]
    assert isinstance(driver, dict)
    seen = []
    is_killed = False
    for event in events:
        seen.append(event)
        if not is_killed and _num_generating(server) > 0:
            os.kill(driver["pid"], signal.SIGKILL)
            is_killed = True
    return seen


def test_a_responses_stream_ends_with_response_failed(server: Server) -> None:
    stream = server.client().responses.create(
        model="dummy", input="Tell a long story.", max_output_tokens=400, stream=True, extra_body=LONG
    )
    events = _read_killing_the_driver(server, stream)
    assert events[0].type == "response.created" and events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "driver_unavailable" and "driver" in failed.error.message
    server.wait_ready()


def test_a_messages_stream_ends_with_an_error_event(server: Server) -> None:
    with anthropic.Anthropic(api_key=API_KEY, base_url=server.url, max_retries=0, timeout=60.0) as client:
        stream = client.messages.create(model="dummy", messages=ASK, max_tokens=400, stream=True, extra_body=LONG)
        with pytest.raises(anthropic.APIStatusError) as info:
            _read_killing_the_driver(server, stream)
        error = anthropic_error(info.value)
        assert error["type"] == "overloaded_error" and "driver" in error["message"]
        server.wait_ready()
        after = client.messages.create(model="dummy", messages=ASK, max_tokens=4)
        assert after.content[0].type == "text"
