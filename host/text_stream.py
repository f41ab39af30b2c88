"""Incremental detokenization on the host: turn a token stream into text pieces that are safe to
send. The host's twin of the SDK's `inferlet.TextDecoder` (the guest cannot import host code),
used when the host streams a generation's text itself (`forward-pass.generate`)."""

from __future__ import annotations

from host.services import Tokenizer


class TextStream:
    """Feed tokens one at a time; get back the text they add. A piece that ends inside a
    multi-byte character is held back until the character is complete; a few tokens of left
    context are kept so tokenizers that merge across token boundaries decode as in one piece."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token: int) -> str:
        self._tokens.append(token)
        prefix, full = self._window()
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""  # a character is still incomplete: wait for the tokens that finish it
        # Advance even past a token with no text (a special token), so the window stays small.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full[len(prefix) :]

    def held(self) -> str:
        """The text of the tokens pushed so far that `push` has not returned yet."""
        prefix, full = self._window()
        return full[len(prefix) :]

    def _window(self) -> tuple[str, str]:
        """(text of the context tokens already returned, text of the whole window)."""
        window = self._tokens[self._prefix_offset :]
        decode = self._tokenizer.decode
        return decode(window[: self._read_offset - self._prefix_offset]), decode(window)
