"""The chat run's results as Responses API objects: the response with its output items (a message,
function calls), and its typed stream events (`response.created` ... `response.completed`).

It reads the chat renderer (which accumulates the run's text and parses its tool calls); it
knows no run, route or store: `on_done` hears of a finished response.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from host.daemon.call_stream import CallArguments, final_arguments
from host.daemon.errors import ApiError
from host.daemon.http_util import sse
from host.daemon.openai_render import Renderer, Update

Item = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(item_id: str, text: str, status: str) -> Item:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [_part(text)]}


def _call_item(ids: tuple[str, str], name: str, arguments: str, status: str) -> Item:
    item_id, call_id = ids
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesWire:
    """One response, whole or as events. `base`: the response's fields that echo the request
    (id, model, instructions, tools, ...); `on_done`: called with the finished response."""

    def __init__(self, base: dict[str, Any], on_done: Callable[[dict[str, Any]], None]) -> None:
        self._base = {**base, "object": "response", "created_at": int(time.time())}
        self._on_done = on_done
        self._message_id = new_id("msg")
        self._call_ids = (new_id("fc"), new_id("call"))  # a forced call's item and call ids
        self._call = CallArguments()
        self._sequence = 0
        self._output: list[Item] | None = None

    # ------------------------------------------------------------------ whole

    def body(self, renderer: Renderer) -> dict[str, Any]:
        response = self._response(renderer, self._status(renderer), self._final_output(renderer))
        self._on_done(response)
        return response

    def _response(self, renderer: Renderer, status: str, output: list[Item]) -> dict[str, Any]:
        response = {**self._base, "status": status, "output": output, "error": None, "incomplete_details": None}
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if status in ("completed", "incomplete"):
            prompt, completion = renderer.prompt_tokens, renderer.completion_tokens
            response["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
        else:
            response["usage"] = None
        return response

    @staticmethod
    def _status(renderer: Renderer) -> str:
        return "completed" if renderer.choices[0].finish_reason == "stop" else "incomplete"

    def _final_output(self, renderer: Renderer) -> list[Item]:
        """The output items of the finished choice (built once: their ids stay the same)."""
        if self._output is not None:
            return self._output
        choice = renderer.choices[0]
        status = self._status(renderer)
        if renderer.job.tool_call == "forced":
            # The arguments as generated (as they stream), not parsed and written again.
            forced = final_arguments(choice.text, choice.finish_reason)
            if forced is not None:
                self._output = [_call_item(self._call_ids, *forced, status)]
                return self._output
        parsed = renderer.tool_calls(choice) if renderer.job.tool_call == "auto" else None
        if parsed is None:
            self._output = [message_item(self._message_id, choice.text, status)]
            return self._output
        content, calls = parsed
        output = [message_item(self._message_id, content, status)] if content else []
        for call in calls:
            function = call["function"]
            ids = (new_id("fc"), new_id("call"))
            output.append(_call_item(ids, function["name"], function["arguments"], status))
        self._output = output
        return output

    # ------------------------------------------------------------------ stream

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(data, event=kind)

    def _streams_text(self, renderer: Renderer) -> bool:
        """Plain text streams as it comes, and so do a forced call's arguments; with "auto"
        tools the text may hold calls between markers, so its items are sent whole when it
        finishes (as chat completions send tool calls)."""
        return not renderer.job.tool_call

    def opening(self, renderer: Renderer) -> list[bytes]:
        response = self._response(renderer, "in_progress", [])
        frames = [self._event("response.created", response=response)]
        frames.append(self._event("response.in_progress", response=response))
        if self._streams_text(renderer):
            frames += self._item_opening(0, message_item(self._message_id, "", "in_progress"))
        return frames

    def frames(self, renderer: Renderer, updates: list[Update]) -> list[bytes]:
        frames = []
        for _index, text, _entries, finish in updates:
            if renderer.job.tool_call == "forced":
                frames += self._call_frames(renderer, finish)
                continue
            if text and self._streams_text(renderer):
                frames.append(self._text_delta(0, text))
            if finish is None:
                continue
            output = self._final_output(renderer)
            if self._streams_text(renderer):
                frames += self._item_closing(0, output[0])
                continue
            for index, item in enumerate(output):
                frames += self._whole_item(index, item)
        return frames

    def _call_frames(self, renderer: Renderer, finish: str | None) -> list[bytes]:
        """A forced call streams its arguments as they are generated, once its name is known."""
        was_open = self._call.name is not None
        delta = self._call.advance(renderer.choices[0].text, finish)
        frames = []
        if self._call.name is not None and not was_open:
            frames += self._item_opening(0, _call_item(self._call_ids, self._call.name, "", "in_progress"))
        if delta:
            where = {"item_id": self._call_ids[0], "output_index": 0}
            frames.append(self._event("response.function_call_arguments.delta", **where, delta=delta))
        if finish is None:
            return frames
        output = self._final_output(renderer)
        if self._call.name is None:  # cut inside its name: its text, as a message
            return frames + self._whole_item(0, output[0])
        return frames + self._item_closing(0, output[0])

    def _item_opening(self, index: int, item: Item) -> list[bytes]:
        if item["type"] == "function_call":
            opened = {**item, "arguments": "", "status": "in_progress"}
            return [self._event("response.output_item.added", output_index=index, item=opened)]
        opened = {**item, "content": [], "status": "in_progress"}
        return [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_part(""),
            ),
        ]

    def _text_delta(self, index: int, text: str) -> bytes:
        return self._event(
            "response.output_text.delta",
            item_id=self._message_id,
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _item_closing(self, index: int, item: Item) -> list[bytes]:
        if item["type"] == "function_call":
            return [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _whole_item(self, index: int, item: Item) -> list[bytes]:
        frames = self._item_opening(index, item)
        if item["type"] == "function_call":
            delta = {"item_id": item["id"], "output_index": index, "delta": item["arguments"]}
            frames.append(self._event("response.function_call_arguments.delta", **delta))
        else:
            frames.append(self._text_delta(index, item["content"][0]["text"]))
        return frames + self._item_closing(index, item)

    def closing(self, renderer: Renderer) -> list[bytes]:
        status = self._status(renderer)
        response = self._response(renderer, status, self._final_output(renderer))
        self._on_done(response)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [self._event(kind, response=response)]

    def failure(self, renderer: Renderer, error: ApiError) -> list[bytes]:
        response = self._response(renderer, "failed", self._output or [])
        response["error"] = {"code": error.code or "server_error", "message": error.message}
        return [self._event("response.failed", response=response)]
