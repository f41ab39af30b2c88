"""`wafer:inferlet/model`: the served model's shape, tokenizer and chat template."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance, Record

from host.api.host_call import field, host_function, record
from host.sandbox.run_state import RunState

INTERFACE = "model"


@host_function
def info(run: RunState) -> Record:
    m = run.services.model
    return record(
        name=m.name,
        vocab_size=m.vocab_size,
        page_size=m.page_size,
        max_context=m.max_context,
        stop_tokens=list(m.stop_token_ids),
        control_tokens=list(m.control_token_ids),
        max_probe_k=m.max_probe_k,
    )


@host_function
def tokenize(run: RunState, text: str) -> list[int]:
    return list(run.services.tokenizer.encode(text))


@host_function
def detokenize(run: RunState, tokens: list[int]) -> str:
    return run.services.tokenizer.decode(tokens)


@host_function
def render_chat(run: RunState, messages: list[Any], add_generation_prompt: bool) -> str:
    pairs = [(str(field(m, "role")), str(field(m, "content"))) for m in messages]
    return run.services.tokenizer.apply_chat_template(pairs, add_generation_prompt)


def register(instance: LinkerInstance) -> None:
    instance.add_func("info", info)
    instance.add_func("tokenize", tokenize)
    instance.add_func("detokenize", detokenize)
    instance.add_func("render-chat", render_chat)
