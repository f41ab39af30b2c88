"""The chat inferlet's messages turned into OpenAI response objects: whole responses, stream
chunks, logprobs in the chat and the legacy layouts, and usage.

Pure: it sees parsed inferlet messages and a tokenizer, never a run or a socket.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from host.daemon.openai_prepare import Job
from host.services import Tokenizer
from host.tokenizer import BytesTokenizer

LogprobEntry = list[Any]  # [token, logprob, top_ids, top_logprobs] as the chat inferlet sends it
Update = tuple[int, str, list[LogprobEntry], str | None]  # a choice's (index, text, entries, finish)
# The markers around calls in "auto" mode: host.grammar.tool_call's defaults (not imported here:
# that module loads xgrammar; a test checks they agree).
CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
# A forced call's text as the grammar writes it (compact), cut anywhere after the name.
_CUT_CALL = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":(.*)\Z', re.DOTALL)


def forced_call(text: str) -> tuple[str, str] | None:
    """A forced call's name and its arguments' text as far as it is generated (with the call's
    own closing brace once that is), or None while its name is not complete."""
    cut = _CUT_CALL.match(text)
    return None if cut is None else (json.loads(cut.group(1)), cut.group(2))


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    entries: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended it, if one did


class Renderer:
    """Accumulates one request's choices and renders them; `kind` is "chat" or "completion"."""

    def __init__(self, kind: str, job: Job, model_name: str, tokenizer: Tokenizer, request_id: str) -> None:
        self.kind = kind
        self.job = job
        self.model = model_name
        self._tokenizer = tokenizer
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        # echo: a completion's text starts with its prompt's (streamed in the first chunk); with
        # logprobs, once the prompt's logprobs come (the inferlet's "prompt_logprobs" message).
        early_echo = bool(job.echo) and not job.logprobs
        self.choices = [Choice(i, job.echo[i // job.n] if early_echo else "") for i in range(job.num_prompts * job.n)]
        self.prompt_tokens = job.prompt_tokens
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ feeding

    def apply(self, message: dict[str, Any]) -> list[Update]:
        """Fold one inferlet message in; returns the (index, text, entries, finish) updates."""
        if "prompt_tokens" in message:
            self.prompt_tokens = sum(int(n) for n in message["prompt_tokens"])
            return []
        updates: dict[int, Update] = {}
        for prompt_index, entries in message.get("prompt_logprobs", ()):
            text = self.job.echo[prompt_index] if self.job.echo else ""
            for index in range(prompt_index * self.job.n, (prompt_index + 1) * self.job.n):
                choice = self.choices[index]
                choice.text, choice.entries = text + choice.text, list(entries) + choice.entries
                updates[index] = (index, text, list(entries), None)
        for index, text, entry in message.get("deltas", ()):
            choice = self.choices[index]
            choice.text += text
            entries = [entry] if entry is not None else []
            choice.entries += entries
            updates[index] = (index, text, entries, None)
        for index, reason, num_tokens, *stop in message.get("finished", ()):
            choice = self.choices[index]
            choice.finish_reason = reason
            choice.num_tokens = int(num_tokens)
            choice.stop_sequence = str(stop[0]) if stop and stop[0] is not None else None
            _, text, entries, _ = updates.get(index, (index, "", [], None))
            updates[index] = (index, text, entries, reason)
        return list(updates.values())

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    # ------------------------------------------------------------------ whole responses

    def response(self) -> dict[str, Any]:
        if self.kind == "chat":
            choices = []
            for c in self.choices:
                message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
                finish = c.finish_reason or "length"
                parsed = self.tool_calls(c)
                if parsed is not None:
                    message["content"], message["tool_calls"] = parsed
                    finish = "tool_calls" if c.finish_reason == "stop" else finish
                logprobs = self._chat_logprobs(c.entries) if self.job.logprobs else None
                choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            obj = "chat.completion"
        else:
            choices = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._legacy_logprobs(c.entries, 0) if self.job.logprobs else None,
                    "finish_reason": c.finish_reason or "length",
                }
                for c in self.choices
            ]
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": None,
        }

    # ------------------------------------------------------------------ stream chunks

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as the OpenAI API does;
        completion streams with echo open each with its prompt's text."""
        if self.kind != "chat":
            return [
                self._chunk([{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": None}])
                for c in self.choices
                if c.text
            ]
        return [
            self._chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for c in self.choices
        ]

    def update_chunks(self, updates: list[Update]) -> list[dict[str, Any]]:
        if self.kind == "chat" and self.job.tool_call:
            return self._tool_chunks(updates)
        chunks = []
        for index, text, entries, finish in updates:
            if text or entries:
                chunks.append(self.content_chunk(index, text, entries))
            if finish is not None:
                if self.kind == "chat":
                    done: dict[str, Any] = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
                else:
                    done = {"index": index, "text": "", "logprobs": None, "finish_reason": finish}
                chunks.append(self._chunk([done]))
        return chunks

    @property
    def is_plain_text(self) -> bool:
        """Its content chunks carry text alone (no logprobs, no tool calls): a stream can build
        them from one template per choice."""
        return not self.job.logprobs and not (self.kind == "chat" and self.job.tool_call)

    def content_chunk(self, index: int, text: str, entries: list[LogprobEntry]) -> dict[str, Any]:
        """The chunk carrying a piece of choice `index`'s text (already applied) and its logprobs."""
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": text},
                "logprobs": self._chat_logprobs(entries) if self.job.logprobs else None,
                "finish_reason": None,
            }
        else:
            offset = len(self.choices[index].text) - len(text)
            choice = {
                "index": index,
                "text": text,
                "logprobs": self._legacy_logprobs(entries, offset) if self.job.logprobs else None,
                "finish_reason": None,
            }
        return self._chunk([choice])

    # ------------------------------------------------------------------ tool calls

    def tool_calls(self, c: Choice) -> tuple[str | None, list[dict[str, Any]]] | None:
        """(content, tool_calls) of a finished tool-call choice, or None when it holds no
        call (plain text in "auto" mode, or a cut one there). A forced call cut by max_tokens
        is still a call, its arguments as far as they were generated (finish_reason "length")."""
        if self.job.tool_call == "forced" and c.finish_reason == "length":
            call = forced_call(c.text)
            if call is None:  # cut inside the name: no call to speak of
                return None
            function = {"name": call[0], "arguments": call[1]}
            return None, [{"id": f"call_{self.id[-16:]}_{c.index}_0", "type": "function", "function": function}]
        if not self.job.tool_call or c.finish_reason != "stop":
            return None
        raw_calls: list[str] = []
        content: str | None = None
        if self.job.tool_call == "forced":
            raw_calls.append(c.text)
        else:
            parts, rest = [], c.text
            while CALL_BEGIN in rest:
                before, _, after = rest.partition(CALL_BEGIN)
                inner, found, rest = after.partition(CALL_END)
                if not found:
                    return None
                parts.append(before)
                raw_calls.append(inner)
            content = ("".join(parts) + rest).strip() or None
        calls = []
        for i, raw in enumerate(raw_calls):
            try:
                call = json.loads(raw)
            except ValueError:
                return None
            function = {"name": call["name"], "arguments": json.dumps(call["arguments"], separators=(",", ":"))}
            calls.append({"id": f"call_{self.id[-16:]}_{c.index}_{i}", "type": "function", "function": function})
        return (content, calls) if calls else None

    def _tool_chunks(self, updates: list[Update]) -> list[dict[str, Any]]:
        """A tool-call choice streams nothing until it finishes (its text is JSON being built);
        then one chunk carries the calls whole (or the text, if it made none)."""
        chunks = []
        for index, _text, _entries, finish in updates:
            if finish is None:
                continue
            choice = self.choices[index]
            parsed = self.tool_calls(choice)
            if parsed is None:
                delta: dict[str, Any] = {"content": choice.text}
            else:
                content, calls = parsed
                delta = {"content": content, "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                finish = "tool_calls" if choice.finish_reason == "stop" else finish
            chunks.append(self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]))
            chunks.append(self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}]))
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = self.usage()
        return chunk

    # ------------------------------------------------------------------ logprobs

    def _text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._tokenizer.decode([token])
            self._token_text[token] = text
        return text

    def _name(self, token: int) -> str:
        """How logprobs name a token: its text, or "token_id:N" (`return_tokens_as_token_ids`)."""
        return f"token_id:{token}" if self.job.tokens_as_ids else self._text(token)

    def _bytes(self, token: int) -> list[int]:
        if isinstance(self._tokenizer, BytesTokenizer):
            return [token] if token < 256 else []
        return list(self._text(token).encode("utf-8"))

    def _chat_logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        content = []
        for token, logprob, top_ids, top_lps in entries:
            content.append(
                {
                    "token": self._name(token),
                    "logprob": logprob,
                    "bytes": self._bytes(token),
                    "top_logprobs": [
                        {"token": self._name(t), "logprob": lp, "bytes": self._bytes(t)}
                        for t, lp in zip(top_ids, top_lps, strict=True)
                    ],
                }
            )
        return {"content": content, "refusal": None}

    def _legacy_logprobs(self, entries: list[LogprobEntry], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for token, logprob, top_ids, top_lps in entries:
            text = self._text(token)
            tokens.append(self._name(token))
            token_lps.append(logprob)
            # A prompt's first token has no logprob (echo): null, with null top logprobs.
            top = {self._name(t): lp for t, lp in zip(top_ids, top_lps, strict=True)}
            tops.append(None if logprob is None else top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
