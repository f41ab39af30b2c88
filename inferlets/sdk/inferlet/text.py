"""Incremental detokenization: turn a token stream into text pieces that are safe to print."""

from __future__ import annotations

from inferlet.model import detokenize


class TextDecoder:
    """Feed tokens one at a time; get back the text they add. Holds back pieces that end inside
    a multi-byte character until the character is complete. Keeps a few tokens of left context so
    tokenizers that strip or merge across token boundaries decode as they would in one piece."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token: int) -> str:
        self._tokens.append(token)
        prefix = detokenize(self._tokens[self._prefix_offset : self._read_offset])
        full = detokenize(self._tokens[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return ""  # a character is still incomplete: wait for the tokens that finish it
        # Advance even when the token added no text (a special token), or the window of
        # tokens decoded each step would grow without bound.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full[len(prefix) :]
