"""A grammar matcher: the parse state of one generation, and the next-token bitmask it allows,
over either engine's state (xgrammar's GrammarMatcher or host.grammar.llg_backend.LLGState).

Owned by one run's thread (not locked). Knows the bridge's logit-mask layout: uint32 words,
ceil(vocab/32) of them, bit j of word i allows token 32*i + j (little-endian bit order). Its parse
history is charged to a HistoryBudget when it has one (host.grammar.history says why and how).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import xgrammar as xgr

from bridge_schema.batch import logit_mask_words
from host.grammar.errors import MatcherError

if TYPE_CHECKING:
    from host.grammar.grammar import Grammar
    from host.grammar.history import HistoryBudget
    from host.grammar.llg_backend import LLGState


def bitmask_words(vocab_size: int) -> int:
    """uint32 words in a next-token bitmask over `vocab_size` tokens: the bridge's logit mask."""
    return logit_mask_words(vocab_size)


def allocate_bitmask(vocab_size: int) -> npt.NDArray[np.uint32]:
    return np.zeros(bitmask_words(vocab_size), dtype=np.uint32)


class Matcher:
    """Accepts tokens one at a time; rolls back; says which tokens may come next."""

    def __init__(
        self,
        grammar: Grammar,
        _state: xgr.GrammarMatcher | LLGState | None = None,
        *,
        budget: HistoryBudget | None = None,
    ) -> None:
        self.grammar = grammar
        self.vocab_size = grammar.vocab_size
        self.num_words = bitmask_words(grammar.vocab_size)
        self._state = grammar.new_state() if _state is None else _state
        self._num_accepted = 0
        # Per accepted token, 1 if it ended with a dangling ED lead byte (host.grammar.utf8_guard).
        self._ends_with_lead = bytearray()
        self._budget = budget
        self._num_charged = 0  # tokens of history charged to the budget (the most ever held)

    @property
    def num_accepted(self) -> int:
        """Tokens accepted since creation or reset, less those rolled back (the rollback limit)."""
        return self._num_accepted

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it here.

        Control tokens are never allowed; a stop token is allowed only where the grammar may end,
        and accepting it terminates the matcher.
        """
        if not 0 <= token_id < self.vocab_size:
            raise MatcherError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        if self._state.is_terminated():
            return False
        guard = self.grammar.utf8_guard
        if guard is not None and guard.refuses(token_id, self._after_lead()):
            return False  # a surrogate, which xgrammar would take for a character
        if self._budget is not None and self._num_accepted == self._num_charged:
            self._budget.charge(1)  # raises past the budget, before the engine grows its history
            self._num_charged += 1
        accepted = bool(self._state.accept_token(token_id))
        if accepted:
            self._num_accepted += 1
            self._ends_with_lead.append(guard is not None and bool(guard.ends_with_lead[token_id]))
        return accepted

    def _after_lead(self) -> bool:
        return bool(self._ends_with_lead) and bool(self._ends_with_lead[-1])

    def accept_tokens(self, token_ids: list[int]) -> int:
        """Accept tokens in order until one is refused; returns how many were accepted."""
        for i, token_id in enumerate(token_ids):
            if not self.accept(token_id):
                return i
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a terminated matcher becomes live again)."""
        if not 0 <= num_tokens <= self._num_accepted:
            raise MatcherError(
                f"cannot roll back {num_tokens} token(s): {self._num_accepted} accepted since the last reset"
            )
        if num_tokens:
            self._state.rollback(num_tokens)
            self._num_accepted -= num_tokens
            del self._ends_with_lead[-num_tokens:]

    def is_terminated(self) -> bool:
        """True once a stop token was accepted (or, with no stop tokens, the grammar is complete)."""
        return bool(self._state.is_terminated())

    def is_completed(self) -> bool:
        """True when the tokens so far form a whole sentence of the grammar (a stop may follow)."""
        return bool(self._state.is_completed())

    def fill_bitmask(self, out: npt.NDArray[np.uint32]) -> bool:
        """Write the allowed next tokens into `out` (uint32, `num_words` long, in place).

        Returns False when every token is allowed (the mask may be skipped). Does not change the
        parse state. A terminated matcher has no next token: stop generating instead.
        """
        if out.dtype != np.uint32 or out.shape != (self.num_words,):
            raise MatcherError(
                f"bitmask must be a uint32 array of shape ({self.num_words},), got {out.dtype} {out.shape}"
            )
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise MatcherError("bitmask must be a writeable, C-contiguous array")
        if self._state.is_terminated():
            raise MatcherError("the matcher has terminated (a stop token was accepted); end the generation")
        # Same bits, int32 view: xgrammar's layout is the bridge's, only the dtype name differs.
        is_constrained = bool(self._state.fill_next_token_bitmask(out.view(np.int32)))
        guard = self.grammar.utf8_guard
        if guard is not None:
            after_lead = self._after_lead()
            if not is_constrained and (after_lead or not guard.is_noop):
                out.fill(0xFFFFFFFF)  # "everything allowed" need not have been written out
            is_constrained = guard.apply(out, after_lead) or is_constrained
        return is_constrained

    def jump_forward(self) -> str:
        """The text every continuation must start with ("" when none, or when terminated).

        An inferlet may tokenize it and feed it as one fill instead of decoding it token by token.
        """
        if self._state.is_terminated():
            return ""
        return str(self._state.find_jump_forward_string())

    def reset(self) -> None:
        self._state.reset()
        self._num_accepted = 0
        self._ends_with_lead.clear()

    def fork(self) -> Matcher:
        """An independent matcher in the same state (for a forked context), charged to the same
        budget for the history it copies."""
        if self._budget is not None:
            self._budget.charge(self._num_accepted)
        try:
            twin = Matcher(self.grammar, self._state.fork(), budget=self._budget)
        except BaseException:
            if self._budget is not None:
                self._budget.refund(self._num_accepted)
            raise
        twin._num_accepted = twin._num_charged = self._num_accepted
        twin._ends_with_lead = bytearray(self._ends_with_lead)
        return twin

    def release(self) -> None:
        """Give this matcher's charge back to its budget (it is being dropped: do not use it
        after). A second release gives nothing more back."""
        if self._budget is not None:
            self._budget.refund(self._num_charged)
        self._num_charged = 0
        self._budget = None
