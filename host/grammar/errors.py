"""Errors of the grammar engine; every one is a `host.errors.HostError`.

    GrammarError                 root of everything host.grammar raises
    ├── InvalidGrammar           the grammar text is malformed or uses what the engine cannot do
    │   ├── InvalidJSONSchema    a JSON schema that is not JSON, or that the engine cannot compile
    │   ├── UnsupportedSchema    a schema using keywords the engine would not enforce (on request)
    │   ├── InvalidRegex         a regex that does not parse or uses an unsupported construct
    │   ├── InvalidEBNF          an EBNF grammar that does not parse
    │   ├── InvalidToolCall      a tool list or tool choice that cannot describe a call
    │   ├── CompileBudgetExceeded  compiling took longer than the compiler's budget
    │   └── GrammarTooLarge      the compiled grammar takes more memory than its budget
    ├── TokenizerUnsupported     the driver's tokenizer cannot be turned into a token table
    ├── MatcherError             a matcher call with bad arguments (token id, rollback depth, mask)
    ├── GrammarLimitExceeded     a run would hold more grammars, matchers or parse history than its bound
    └── CompileFailed            the process compiling a grammar ended without a result (it crashed)

Messages name the problem and where it is, so an HTTP layer can return them as a 4xx as they are.
"""

from __future__ import annotations

from host.errors import HostError


class GrammarError(HostError):
    """Root of the grammar engine's errors."""


class InvalidGrammar(GrammarError):
    """`kind` is the grammar kind ("json_schema", "regex", ...); `reason` is the engine's words."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"invalid {kind} grammar: {reason}")
        self.kind = kind
        self.reason = reason


class InvalidJSONSchema(InvalidGrammar):
    def __init__(self, reason: str) -> None:
        super().__init__("json_schema", reason)


class UnsupportedSchema(InvalidJSONSchema):
    """No engine enforces the whole schema (raised with `reject_unsupported=True`, or when the
    one engine asked for refuses). `features` are xgrammar's gaps, "keyword at /json/pointer";
    `refusal` is llguidance's own reason when it was tried."""

    def __init__(self, features: tuple[str, ...], refusal: str = "") -> None:
        shown = ", ".join(features[:8]) + (f" (and {len(features) - 8} more)" if len(features) > 8 else "")
        if refusal:
            shown = f"{shown} (llguidance: {refusal})" if shown else f"llguidance: {refusal}"
        super().__init__(f"the schema uses keywords the grammar engines do not enforce: {shown}")
        self.features = features
        self.refusal = refusal


class InvalidRegex(InvalidGrammar):
    def __init__(self, reason: str) -> None:
        super().__init__("regex", reason)


class InvalidEBNF(InvalidGrammar):
    def __init__(self, reason: str) -> None:
        super().__init__("ebnf", reason)


class InvalidToolCall(InvalidGrammar):
    def __init__(self, reason: str) -> None:
        super().__init__("tool_call", reason)


class CompileBudgetExceeded(InvalidGrammar):
    """The compile (waiting for a worker included) took longer than the budget; it was stopped
    (host.grammar.compiler says when it could not be, and goes on to be cached)."""

    def __init__(self, kind: str, budget_s: float) -> None:
        super().__init__(
            kind,
            f"compiling it took longer than this host's budget of {budget_s:g} s (grammar_compile_budget_s); "
            "simplify the grammar, or retry when the host is less busy",
        )
        self.budget_s = budget_s


class GrammarTooLarge(InvalidGrammar):
    """The compiled grammar takes more memory than one grammar may (it is not kept)."""

    def __init__(self, kind: str, size_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            kind,
            f"the compiled grammar takes {size_bytes / 2**20:.1f} MiB, more than this host's budget of "
            f"{budget_bytes / 2**20:g} MiB per grammar (grammar_max_mib); simplify the grammar",
        )
        self.size_bytes = size_bytes
        self.budget_bytes = budget_bytes


class TokenizerUnsupported(GrammarError):
    """The tokenizer description from the driver's handshake cannot be made into a token table."""


class MatcherError(GrammarError):
    """A matcher call whose arguments are wrong; the matcher's state is unchanged."""


class GrammarLimitExceeded(GrammarError):
    """A run asked for more grammars, matchers or matcher history than one run may hold; nothing
    was created or accepted. The message names the limit and what frees room."""


class CompileFailed(GrammarError):
    """The child process compiling a grammar died without an answer (out of memory, a crash in an
    engine); the grammar is not kept."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"compiling the {kind} grammar failed: {reason}")
        self.kind = kind
