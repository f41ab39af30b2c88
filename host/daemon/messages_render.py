"""The chat run's results as Anthropic Messages API objects: the message with its content blocks
(text, tool_use), its stream events (`message_start` ... `message_stop`), and Anthropic's error
envelope, which every answer on the Messages routes uses.

It reads the chat renderer (which accumulates the run's text and parses its tool calls); it
knows no run or route.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from host.daemon.call_stream import CallArguments, final_arguments
from host.daemon.errors import ApiError
from host.daemon.http_util import sse
from host.daemon.openai_render import Renderer, Update

MESSAGES_PATH = "/v1/messages"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

Block = dict[str, Any]


def speaks_anthropic(path: str) -> bool:
    """Whether answers on `path`, errors included, take Anthropic's form."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_envelope(error: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _tool_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


class MessagesWire:
    """One message, whole or as events."""

    def __init__(self, model: str) -> None:
        self._id = f"msg_{secrets.token_hex(16)}"
        self._model = model
        self._blocks: list[Block] | None = None
        self._tool_id = _tool_id()  # a forced call's
        self._call = CallArguments()

    def _message(self, renderer: Renderer, content: list[Block], stop_reason: str | None) -> dict[str, Any]:
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": renderer.choices[0].stop_sequence,
            "usage": {"input_tokens": renderer.prompt_tokens, "output_tokens": renderer.completion_tokens},
        }

    def body(self, renderer: Renderer) -> dict[str, Any]:
        return self._message(renderer, self._final_blocks(renderer), self._stop_reason(renderer))

    def _final_blocks(self, renderer: Renderer) -> list[Block]:
        """The content blocks of the finished choice (built once: their ids stay the same). A
        call cut by max_tokens has no input to speak of: its text comes as text."""
        if self._blocks is not None:
            return self._blocks
        choice = renderer.choices[0]
        if renderer.job.tool_call == "forced":
            call = final_arguments(choice.text, choice.finish_reason)
            calls = [(self._tool_id, *call)] if call is not None else []
            content = None
        elif renderer.job.tool_call == "auto" and (parsed := renderer.tool_calls(choice)) is not None:
            content = parsed[0]
            calls = [(_tool_id(), c["function"]["name"], c["function"]["arguments"]) for c in parsed[1]]
        else:
            calls, content = [], choice.text
        blocks: list[Block] = [{"type": "text", "text": content}] if content else []
        try:
            for tool_id, name, arguments in calls:
                blocks.append({"type": "tool_use", "id": tool_id, "name": name, "input": json.loads(arguments)})
        except ValueError:
            blocks = []
        if not any(block["type"] == "tool_use" for block in blocks):
            blocks = [{"type": "text", "text": choice.text}]
        self._blocks = blocks
        return blocks

    def _stop_reason(self, renderer: Renderer) -> str:
        if renderer.choices[0].finish_reason != "stop":
            return "max_tokens"
        if renderer.choices[0].stop_sequence is not None:
            return "stop_sequence"
        has_call = any(block["type"] == "tool_use" for block in self._final_blocks(renderer))
        return "tool_use" if has_call else "end_turn"

    # ------------------------------------------------------------------ stream

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, event=kind)

    def opening(self, renderer: Renderer) -> list[bytes]:
        started = self._message(renderer, [], None)
        started["usage"]["output_tokens"] = 0
        frames = [self._event("message_start", message=started)]
        if not renderer.job.tool_call:
            block = {"type": "text", "text": ""}
            frames.append(self._event("content_block_start", index=0, content_block=block))
        return frames

    def frames(self, renderer: Renderer, updates: list[Update]) -> list[bytes]:
        """Plain text streams as it comes; a tool-call run's text is JSON being built, so its
        blocks are sent whole when it finishes (as chat completions send tool calls)."""
        frames = []
        for _index, text, _entries, finish in updates:
            if renderer.job.tool_call == "forced":
                frames += self._call_frames(renderer, finish)
                continue
            if text and not renderer.job.tool_call:
                frames.append(self._event("content_block_delta", index=0, delta={"type": "text_delta", "text": text}))
            if finish is None:
                continue
            if not renderer.job.tool_call:
                frames.append(self._event("content_block_stop", index=0))
                continue
            for index, block in enumerate(self._final_blocks(renderer)):
                frames += self._whole_block(index, block)
        return frames

    def _call_frames(self, renderer: Renderer, finish: str | None) -> list[bytes]:
        """A forced call streams its input's JSON as it is generated, once its name is known."""
        was_open = self._call.name is not None
        delta = self._call.advance(renderer.choices[0].text, finish)
        frames = []
        if self._call.name is not None and not was_open:
            block = {"type": "tool_use", "id": self._tool_id, "name": self._call.name, "input": {}}
            frames.append(self._event("content_block_start", index=0, content_block=block))
        if delta:
            json_delta = {"type": "input_json_delta", "partial_json": delta}
            frames.append(self._event("content_block_delta", index=0, delta=json_delta))
        if finish is None:
            return frames
        if self._call.name is None:  # cut inside its name: its text, as a text block
            return frames + self._whole_block(0, self._final_blocks(renderer)[0])
        return [*frames, self._event("content_block_stop", index=0)]

    def _whole_block(self, index: int, block: Block) -> list[bytes]:
        if block["type"] == "tool_use":
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        else:
            opened = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        return [
            self._event("content_block_start", index=index, content_block=opened),
            self._event("content_block_delta", index=index, delta=delta),
            self._event("content_block_stop", index=index),
        ]

    def closing(self, renderer: Renderer) -> list[bytes]:
        delta = {"stop_reason": self._stop_reason(renderer), "stop_sequence": renderer.choices[0].stop_sequence}
        usage = {"output_tokens": renderer.completion_tokens}
        return [self._event("message_delta", delta=delta, usage=usage), self._event("message_stop")]

    def failure(self, renderer: Renderer, error: ApiError) -> list[bytes]:
        return [sse(anthropic_envelope(error), event="error")]
