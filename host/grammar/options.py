"""Each grammar kind's options with their defaults, the error each kind raises, and the engines a
caller may name; options are checked before a compile, so a typo is refused, not ignored.

Knows the kinds, not how any of them is compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from host.grammar import tool_call
from host.grammar.errors import (
    InvalidEBNF,
    InvalidGrammar,
    InvalidJSONSchema,
    InvalidRegex,
    InvalidToolCall,
)
from host.grammar.grammar import KINDS, OptionItems

Option = bool | str | int
# Each kind's options and their defaults; anything else is refused, so a typo is not ignored.
OPTIONS: dict[str, dict[str, Option]] = {
    "json_object": {"compact": True},
    "json": {"compact": True},
    "json_schema": {
        "strict": True,
        "compact": True,
        "reject_unsupported": False,
        "max_length_limit": 32,
        "backend": "auto",
    },
    "regex": {},
    "ebnf": {"root": "root"},
    "tool_call": {
        "choice": "required",
        "strict": True,
        "reject_unsupported": False,
        "max_length_limit": 32,
        "call_begin": tool_call.DEFAULT_CALL_BEGIN,
        "call_end": tool_call.DEFAULT_CALL_END,
        "backend": "auto",
    },
}
ERRORS: dict[str, Callable[[str], InvalidGrammar]] = {
    "json_object": InvalidJSONSchema,
    "json": InvalidJSONSchema,
    "json_schema": InvalidJSONSchema,
    "regex": InvalidRegex,
    "ebnf": InvalidEBNF,
    "tool_call": InvalidToolCall,
}
# The engines a json_schema or tool_call grammar may ask for ("auto": see host.grammar.builder).
BACKENDS = ("auto", "xgrammar", "llguidance")


def option_items(kind: str, options: Mapping[str, Option]) -> OptionItems:
    """`options` merged over the defaults of `kind`, checked and sorted (a GrammarKey's part)."""
    if kind not in OPTIONS:
        raise InvalidGrammar(kind, f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")
    defaults = OPTIONS[kind]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise InvalidGrammar(kind, f"unknown option(s) {unknown}; {kind} takes {sorted(defaults) or 'none'}")
    merged = {**defaults, **options}
    for name, value in merged.items():
        if type(value) is not type(defaults[name]):
            raise InvalidGrammar(kind, f"option {name!r} must be {type(defaults[name]).__name__}, got {value!r}")
    if "backend" in merged and merged["backend"] not in BACKENDS:
        raise ERRORS[kind](f"unknown backend {merged['backend']!r}; expected one of {', '.join(BACKENDS)}")
    return tuple(sorted(merged.items()))
