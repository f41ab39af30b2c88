"""The model the host serves: its shape, tokenizer and chat template."""

from __future__ import annotations

from dataclasses import dataclass

from wit_world.imports import model as _model


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    page_size: int
    max_context: int
    stop_tokens: tuple[int, ...]
    control_tokens: tuple[int, ...]
    max_probe_k: int  # the most top tokens one probe (`ctx.top_k`, logprobs) may report


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


_info: ModelInfo | None = None


def model_info() -> ModelInfo:
    """The served model's shape (fetched once per run, then cached)."""
    global _info
    if _info is None:
        raw = _model.info()
        _info = ModelInfo(
            name=raw.name,
            vocab_size=raw.vocab_size,
            page_size=raw.page_size,
            max_context=raw.max_context,
            stop_tokens=tuple(raw.stop_tokens),
            control_tokens=tuple(raw.control_tokens),
            max_probe_k=raw.max_probe_k,
        )
    return _info


def tokenize(text: str) -> list[int]:
    return list(_model.tokenize(text))


def detokenize(tokens: list[int]) -> str:
    return _model.detokenize(list(tokens))


def render_chat(messages: list[ChatMessage] | list[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """Render messages (ChatMessage or (role, content) pairs) with the model's chat template."""
    wit_messages = []
    for m in messages:
        role, content = (m.role, m.content) if isinstance(m, ChatMessage) else m
        wit_messages.append(_model.ChatMessage(role=role, content=content))
    return _model.render_chat(wit_messages, add_generation_prompt)
