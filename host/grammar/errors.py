"""Errors of the grammar engine; every one is a `host.errors.HostError`.

    GrammarError                 root of everything host.grammar raises
    ├── InvalidGrammar           the grammar text is malformed or uses what the engine cannot do
    │   ├── InvalidJSONSchema    a JSON schema that is not JSON, or that the engine cannot compile
    │   ├── UnsupportedSchema    a schema using keywords the engine would not enforce (on request)
    │   ├── InvalidRegex         a regex that does not parse or uses an unsupported construct
    │   ├── InvalidEBNF          an EBNF grammar that does not parse
    │   └── InvalidToolCall      a tool list or tool choice that cannot describe a call
    ├── TokenizerUnsupported     the driver's tokenizer cannot be turned into a token table
    └── MatcherError             a matcher call with bad arguments (token id, rollback depth, mask)

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
    """Raised only with `reject_unsupported=True`; `features` are "keyword at /json/pointer"."""

    def __init__(self, features: tuple[str, ...]) -> None:
        shown = ", ".join(features[:8]) + (f" (and {len(features) - 8} more)" if len(features) > 8 else "")
        super().__init__(f"the schema uses keywords the grammar engine does not enforce: {shown}")
        self.features = features


class InvalidRegex(InvalidGrammar):
    def __init__(self, reason: str) -> None:
        super().__init__("regex", reason)


class InvalidEBNF(InvalidGrammar):
    def __init__(self, reason: str) -> None:
        super().__init__("ebnf", reason)


class InvalidToolCall(InvalidGrammar):
    def __init__(self, reason: str) -> None:
        super().__init__("tool_call", reason)


class TokenizerUnsupported(GrammarError):
    """The tokenizer description from the driver's handshake cannot be made into a token table."""


class MatcherError(GrammarError):
    """A matcher call whose arguments are wrong; the matcher's state is unchanged."""
