"""The parse history a group of matchers (one run's) may hold together, counted in tokens.

Both engines keep a parse state per accepted token so that `rollback` can return to it: measured
with xgrammar 0.2.8, 40-170 bytes per byte of text inside a JSON string and 400-830 in "any JSON"
(llguidance: 1-15). That memory stays after a rollback or a reset (the engine keeps its buffers),
and a fork copies it. So a matcher is charged the most tokens it has ever held, a fork
what it copies, and only dropping a matcher gives its charge back. Knows no engine.
"""

from __future__ import annotations

import threading

from host.grammar.errors import GrammarLimitExceeded


class HistoryBudget:
    """Thread-safe: a run's matchers may be advanced by the engine's thread while the run waits."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Tokens charged now, over every matcher of the group."""
        return self._used

    def charge(self, num_tokens: int) -> None:
        """Take `num_tokens`; GrammarLimitExceeded (nothing taken) past the budget."""
        with self._lock:
            if self._used + num_tokens > self.max_tokens:
                raise GrammarLimitExceeded(
                    f"grammar limit exceeded: the run's matchers would hold {self._used + num_tokens} accepted "
                    f"tokens, more than the {self.max_tokens} a run may (each matcher counts the most tokens it "
                    "has held since it was created, a fork the tokens it copies); release matchers you are done with"
                )
            self._used += num_tokens

    def refund(self, num_tokens: int) -> None:
        with self._lock:
            self._used -= num_tokens
