"""The model's tokenizer and chat template, built from the driver's `Handshake`.

Two kinds: "bytes" (ids 0..255 are the bytes of UTF-8 text, higher ids are special tokens with no
text; the dummy driver uses it) and "huggingface" (a tokenizer.json for the `tokenizers` package).
Chat templates are jinja2 rendered in a sandbox: a template comes from the driver's model files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bridge_schema.messages import Handshake
from host.errors import DriverFailed, InvalidRequest

# Used when the driver reports no template: ChatML, which most instruct models understand.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            self._template = env.from_string(source or DEFAULT_CHAT_TEMPLATE)
        except TemplateError as exc:
            raise DriverFailed(f"the model's chat template does not compile: {exc}") from None
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(
                messages=[{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}") from None


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


class BytesTokenizer:
    """ids 0..255 are bytes; any other id is a special token that decodes to ""."""

    def __init__(self, vocab_size: int, chat_template: str = "") -> None:
        if vocab_size < 256:
            raise DriverFailed(f"a bytes tokenizer needs a vocabulary of at least 256, got {vocab_size}")
        self.vocab_size = vocab_size
        self._template = ChatTemplate(chat_template)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
        return self._template.render(messages, add_generation_prompt)


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer; special tokens written in text (from a chat template) are
    parsed as special tokens, as the model was trained."""

    def __init__(self, tokenizer_json: str, chat_template: str = "", stop_token_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok: Any = _Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the tokenizers package raises bare Exception subclasses
            raise DriverFailed(f"the driver's tokenizer.json does not load: {exc}") from None
        eos = self._tok.id_to_token(stop_token_ids[0]) if stop_token_ids else None
        self._template = ChatTemplate(chat_template, eos_token=eos or "")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=False))

    def apply_chat_template(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
        return self._template.render(messages, add_generation_prompt)


def tokenizer_from_handshake(handshake: Handshake) -> BytesTokenizer | HuggingFaceTokenizer:
    kind = handshake.tokenizer_kind
    if kind == "bytes":
        return BytesTokenizer(handshake.vocab_size, handshake.chat_template)
    if kind == "huggingface":
        stops = [int(t) for t in handshake.stop_token_ids]
        return HuggingFaceTokenizer(handshake.tokenizer_data, handshake.chat_template, stops)
    raise DriverFailed(f"unknown tokenizer kind {kind!r} in the driver's handshake (expected bytes or huggingface)")
