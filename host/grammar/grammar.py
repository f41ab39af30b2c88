"""A compiled grammar: immutable, shared by every matcher (and every run) that uses it.

Knows how it was asked for (kind, text, options) but not how it was compiled or cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xgrammar as xgr

from host.grammar.history import HistoryBudget
from host.grammar.llg_backend import CompiledLLG, LLGState
from host.grammar.matcher import Matcher
from host.grammar.utf8_guard import Utf8Guard

# The kinds a caller may ask for (WIT and HTTP name them the same way).
KINDS = ("json_object", "json", "json_schema", "regex", "ebnf", "tool_call")

OptionItems = tuple[tuple[str, bool | str | int], ...]


@dataclass(frozen=True, slots=True)
class GrammarKey:
    kind: str
    text: str
    options: OptionItems = ()


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """`unsupported` lists schema keywords compiled without being enforced ("not at /x");
    an output may break those. Empty for every kind but json_schema and tool_call.
    `backend` is the engine that compiled it: "xgrammar" or "llguidance"."""

    key: GrammarKey
    compiled: xgr.CompiledGrammar | CompiledLLG
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    unsupported: tuple[str, ...] = ()
    compile_time_s: float = field(default=0.0, compare=False)
    utf8_guard: Utf8Guard | None = field(default=None, compare=False)  # see host.grammar.utf8_guard

    @property
    def kind(self) -> str:
        return self.key.kind

    @property
    def text(self) -> str:
        return self.key.text

    @property
    def options(self) -> dict[str, bool | str | int]:
        return dict(self.key.options)

    backend: str = "xgrammar"

    def matcher(self, budget: HistoryBudget | None = None) -> Matcher:
        """A fresh matcher; its parse history is charged to `budget` when given."""
        return Matcher(self, budget=budget)

    @property
    def memory_bytes(self) -> int:
        """Memory the compiled grammar holds (xgrammar's own count; for llguidance its
        serialized grammar). Budgeted and cached by this."""
        if isinstance(self.compiled, CompiledLLG):
            return self.compiled.memory_bytes
        return int(self.compiled.memory_size_bytes)

    def new_state(self) -> xgr.GrammarMatcher | LLGState:
        """A fresh parse state of the engine that compiled this grammar (for Matcher)."""
        if isinstance(self.compiled, CompiledLLG):
            return self.compiled.new_state()
        # Without stop tokens a completed grammar would allow nothing at all; end it there instead.
        return xgr.GrammarMatcher(self.compiled, terminate_without_stop_token=not self.stop_token_ids)
