"""Inferlets as models: `chat_model(answer)` makes an inferlet's `main` speak the chat protocol
that the daemon's chat APIs (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
`/v1/messages`) run, the one the built-in `chat` inferlet speaks (inferlets/chat/README.md).
Uploaded with `POST /v1/inferlets?model=NAME`, the inferlet is then the model `wafer/NAME` for
the key that uploaded it, through every one of those APIs.

    from inferlet import ChatRequest, Context, chat_model

    def answer(req: ChatRequest):
        with Context() as ctx:
            ctx.fill(req.prompt)
            yield from ctx.generate_text(req.max_tokens, sampler=req.sampler, grammar=req.grammar())

    main = chat_model(answer)

`answer` is called once per choice (a request's prompts times its `n`) and returns the choice's
text, whole or as an iterable of pieces (each piece streams to the client as it comes). Stop
strings, usage and the finish reason are this module's: a choice ends "length" when its text
takes `max_tokens` tokens, else "stop".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from inferlet.errors import InferletError
from inferlet.grammar import Grammar
from inferlet.model import render_chat, tokenize
from inferlet.runtime import send
from inferlet.sampling import Greedy, Random


@dataclass(frozen=True)
class ChatRequest:
    """One choice of a chat request, as the daemon prepared it."""

    messages: list[tuple[str, str]]
    """The prompt's (role, content) messages; [] when the prompt is text or tokens."""
    prompt: list[int]
    """The prompt's tokens, the model's chat template applied (with the generation prompt)."""
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    choice: int
    """Which choice this is: prompt index times `n`, plus the branch."""
    options: dict[str, Any] = field(default_factory=dict)
    """The whole request (inferlets/chat/README.md: stop, logprobs, penalties, grammar, ...)."""

    @property
    def sampler(self) -> Greedy | Random:
        """The request's temperature and top_p, seeded with seed + choice where it has a seed."""
        if self.temperature == 0 or self.top_p == 0:
            return Greedy()
        seed = -1 if self.seed is None else (self.seed + self.choice) % (1 << 63)
        return Random(self.temperature, top_p=self.top_p, seed=seed)

    def grammar(self) -> Grammar | None:
        """The grammar the text must follow (a response_format, or tools: then the text is the
        tool call the daemon turns into the API's tool calls), or None."""
        spec = self.options.get("grammar")
        return None if spec is None else Grammar(spec["kind"], spec["text"], **spec["options"])


Answer = Callable[[ChatRequest], "Iterable[str] | str"]


def chat_model(answer: Answer) -> Callable[[list[str]], None]:
    """An inferlet `main` that answers every choice of a chat request with `answer`."""

    def main(args: list[str]) -> None:
        if len(args) != 1:
            raise InferletError("a chat model takes one argument: the request as JSON (inferlets/chat/README.md)")
        request = json.loads(args[0])
        prompts = [_prompt(p) for p in request["prompts"]]
        send(json.dumps({"prompt_tokens": [len(tokens) for _, tokens in prompts]}))
        n = int(request.get("n", 1))
        stops = [s for s in request.get("stop", []) if s]
        seed = request.get("seed")
        for p_index, (messages, tokens) in enumerate(prompts):
            for branch in range(n):
                req = ChatRequest(
                    messages=messages,
                    prompt=tokens,
                    max_tokens=int(request["max_tokens"]),
                    temperature=float(request.get("temperature", 1.0)),
                    top_p=float(request.get("top_p", 1.0)),
                    seed=None if seed is None else int(seed),
                    choice=p_index * n + branch,
                    options=request,
                )
                _serve_choice(req, answer(req), stops)

    return main


def _prompt(prompt: dict[str, Any]) -> tuple[list[tuple[str, str]], list[int]]:
    if "messages" in prompt:
        messages = [(str(m[0]), str(m[1])) for m in prompt["messages"]]
        return messages, tokenize(render_chat(messages, True))
    if "text" in prompt:
        return [], tokenize(prompt["text"])
    return [], [int(t) for t in prompt["tokens"]]


def _serve_choice(req: ChatRequest, text: Iterable[str] | str, stops: list[str]) -> None:
    """Stream one choice's pieces as deltas, cut at the first stop string (text that could begin
    one is held back until it cannot), then say how it finished."""
    pieces = [text] if isinstance(text, str) else text
    hold = max((len(s) for s in stops), default=1) - 1
    whole, sent, matched = "", 0, None
    for piece in pieces:
        whole += piece
        found = [(i, s) for s in stops if (i := whole.find(s, max(0, sent - hold))) >= 0]
        if found:
            cut, matched = min(found, key=lambda hit: hit[0])
            whole = whole[:cut]
            break
        if len(whole) - hold > sent:
            _delta(req.choice, whole[sent : len(whole) - hold])
            sent = len(whole) - hold
    if len(whole) > sent:
        _delta(req.choice, whole[sent:])
    num_tokens = len(tokenize(whole)) if whole else 0
    reason = "length" if matched is None and num_tokens >= req.max_tokens else "stop"
    send(json.dumps({"deltas": [], "finished": [[req.choice, reason, num_tokens, matched]]}))


def _delta(index: int, text: str) -> None:
    send(json.dumps({"deltas": [[index, text, None]]}))
