"""Host-side grammars for constrained decoding (xgrammar): compile once, match per generation.

spec = TokenizerSpec.from_handshake(handshake)
compiler = GrammarCompiler(spec)               # one per driver; thread-safe, LRU-cached
matcher = compiler.json_schema(schema).matcher()
mask = allocate_bitmask(spec.vocab_size)
while not matcher.is_terminated():
    matcher.fill_bitmask(mask)                 # the bridge's logit-mask words
    token = sample(..., mask); matcher.accept(token)
"""

from __future__ import annotations

from host.grammar.compiler import GrammarCompiler
from host.grammar.errors import (
    CompileBudgetExceeded,
    CompileFailed,
    GrammarError,
    GrammarLimitExceeded,
    GrammarTooLarge,
    InvalidEBNF,
    InvalidGrammar,
    InvalidJSONSchema,
    InvalidRegex,
    InvalidToolCall,
    MatcherError,
    TokenizerUnsupported,
    UnsupportedSchema,
)
from host.grammar.grammar import KINDS, Grammar, GrammarKey
from host.grammar.matcher import Matcher, allocate_bitmask, bitmask_words
from host.grammar.options import OPTIONS
from host.grammar.tokenizer_info import TokenizerSpec, token_table, tokenizer_info

__all__ = [
    "KINDS",
    "OPTIONS",
    "CompileBudgetExceeded",
    "CompileFailed",
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarKey",
    "GrammarLimitExceeded",
    "GrammarTooLarge",
    "InvalidEBNF",
    "InvalidGrammar",
    "InvalidJSONSchema",
    "InvalidRegex",
    "InvalidToolCall",
    "Matcher",
    "MatcherError",
    "TokenizerSpec",
    "TokenizerUnsupported",
    "UnsupportedSchema",
    "allocate_bitmask",
    "bitmask_words",
    "token_table",
    "tokenizer_info",
]
