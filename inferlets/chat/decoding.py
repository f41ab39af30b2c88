"""Per-branch decoding state: incremental UTF-8 text and stop-sequence matching."""

from dataclasses import dataclass, field

from inferlet import detokenize


class Utf8Decoder:
    """Token ids in, printable text out: holds back text that ends inside a multi-byte
    character until it completes; `flush` gives whatever is held back."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._emitted = 0  # characters of detokenize(self._tokens) already returned

    def push(self, token: int) -> str:
        self._tokens.append(token)
        text = detokenize(self._tokens)
        if text.endswith("\ufffd"):
            return ""
        piece = text[self._emitted :]
        self._emitted = len(text)
        # Keep a few tokens of left context (some tokenizers merge across boundaries) but not the
        # whole sequence, so each step costs O(1) and not O(length).
        if len(self._tokens) > 8:
            keep = self._tokens[-4:]
            self._tokens = keep
            self._emitted = len(detokenize(keep))
        return piece

    def flush(self) -> str:
        text = detokenize(self._tokens)
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece


class StopMatcher:
    """Finds the first stop sequence in the generated text. Text that could still be the start
    of a stop sequence is held back, so a stop sequence never reaches the client."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._held = ""
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.matched: str | None = None  # the stop sequence found, once one is

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop sequence was found)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        found = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda hit: hit[0])
            self._held = ""
            return buf[:cut], True
        safe = len(buf) - self._hold if self._hold else len(buf)
        # Never split where a stop sequence could begin: find the earliest suffix that is a prefix.
        for start in range(max(safe, 0), len(buf)):
            if any(s.startswith(buf[start:]) for s in self._stops):
                safe = start
                break
        else:
            safe = len(buf)
        self._held = buf[safe:]
        return buf[:safe], False

    def flush(self, text: str = "") -> str:
        out, hit = self.push(text)
        if hit:
            return out
        out += self._held
        self._held = ""
        return out


@dataclass
class Branch:
    index: int
    ctx: object
    pending: int
    sampler: object
    decoder: Utf8Decoder
    stop: StopMatcher
    num_tokens: int = 0
    finish_reason: str | None = field(default=None)
    matcher: object = field(default=None)  # a grammar matcher constraining every step, or None
    stages: object = field(default=None)  # a Chain's (logit bias, penalties), or None
