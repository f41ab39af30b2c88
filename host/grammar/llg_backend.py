"""The second grammar engine, llguidance (the one behind vLLM's `guidance` backend), for the
JSON schemas xgrammar would not enforce.

Sound options are forced: unknown keywords are an error (`lenient` off), `oneOf` is never read
as `anyOf` (`coerce_one_of` off), and compact grammars allow no whitespace; a client's
`x-guidance` key is removed before compiling, so it cannot turn them back on. The parse state is
wrapped to behave like xgrammar's matcher (a refused token leaves the state unchanged, a stop
token terminates), so `host.grammar.Matcher` serves both engines the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np
import numpy.typing as npt

from host.grammar.tokenizer_info import PerTokenizer, TokenizerSpec, token_table

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

BACKEND = "llguidance"
# llguidance builds its lexer lazily, as masks are computed; each state takes 1-2 kB. Its default
# (250,000) lets one matcher grow to about 0.5 GB; this keeps one under about 100 MB. The corpus
# tests run every instance of 133 real schemas under it.
MAX_LEXER_STATES = 50_000
LIMITS = llg.LLParserLimits(max_lexer_states=MAX_LEXER_STATES)


class _TokenTable:
    """What llguidance's TokenizerWrapper reads: the bytes of each token and the special ids.

    Its tokenize call is used only to print debug traces and to tokenize forced text, which this
    host never asks of it; a greedy tokenization over the table is enough and exact in bytes."""

    def __init__(self, table: Sequence[bytes], spec: TokenizerSpec) -> None:
        self.tokens = list(table)
        self.eos_token_id = spec.stop_token_ids[0] if spec.stop_token_ids else 0
        self.bos_token_id = None
        self.special_token_ids = sorted({*spec.control_token_ids, *spec.stop_token_ids})
        self._by_bytes = {token: i for i, token in enumerate(self.tokens) if token}
        self._longest = max((len(t) for t in self._by_bytes), default=1)

    def __call__(self, text: bytes) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for width in range(min(self._longest, len(text) - i), 0, -1):
                token_id = self._by_bytes.get(text[i : i + width])
                if token_id is not None:
                    ids.append(token_id)
                    i += width
                    break
            else:
                i += 1  # a byte no token spells (cannot happen for byte-level tables)
        return ids


def _build_tokenizer(spec: TokenizerSpec) -> llg.LLTokenizer:
    wrapper = llg.TokenizerWrapper(_TokenTable(token_table(spec), spec))
    return llg.LLTokenizer(wrapper, n_vocab=spec.vocab_size, eos_token=list(spec.stop_token_ids) or None)


_tokenizers: PerTokenizer[llg.LLTokenizer] = PerTokenizer(_build_tokenizer)


def tokenizer(spec: TokenizerSpec) -> llg.LLTokenizer:
    """llguidance's view of `spec`, built once per tokenizer (0.1 s for SmolLM2's 49k tokens)."""
    return _tokenizers.get(spec)


class Refused(Exception):
    """llguidance will not compile this grammar; the message is its own (one line)."""


@dataclass(frozen=True, slots=True)
class CompiledLLG:
    """A grammar llguidance validated for one tokenizer; each matcher parses it afresh (cheap:
    its lexer is built lazily)."""

    tokenizer: llg.LLTokenizer
    grammar: str
    stop_token_ids: tuple[int, ...]

    def new_state(self) -> LLGState:
        return LLGState(self, llg.LLMatcher(self.tokenizer, self.grammar, log_level=0, limits=LIMITS))

    @property
    def memory_bytes(self) -> int:
        """What the compiled grammar holds (its serialized form; matchers add their lexer
        states, at most MAX_LEXER_STATES each)."""
        return len(self.grammar)


def _options(compact: bool) -> JsonCompileOptions:
    options: JsonCompileOptions = {"lenient": False, "coerce_one_of": False}
    if compact:
        options |= {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    else:
        options |= {"whitespace_flexible": True}
    return options


def _document(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """A boolean schema as its object form; a client's x-guidance options dropped."""
    if schema is False:
        return {"not": {}}  # refused: llguidance has no `not`, and nothing would be valid anyway
    return {k: v for k, v in schema.items() if k != "x-guidance"} if isinstance(schema, dict) else {}


def compile_json_schema(spec: TokenizerSpec, schema: dict[str, Any] | bool, *, compact: bool) -> CompiledLLG:
    """`schema` (parsed, already closed for strict mode where wanted) as a checked grammar;
    raises Refused with llguidance's reason."""
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(_document(schema), overrides=_options(compact))
    except ValueError as exc:
        raise Refused(str(exc)) from None
    return _checked(spec, grammar)


def compile_tool_calls(spec: TokenizerSpec, calls: Sequence[tuple[str, dict[str, Any] | bool]]) -> CompiledLLG:
    """Exactly one call, `{"name":NAME,"arguments":ARGS}` (compact), of one of `calls` (name,
    parameter schema): a Lark grammar with each schema inline, its options forced in its own
    x-guidance key (where llguidance reads them for an inline schema)."""
    rules = [f"start: {' | '.join(f'call_{i}' for i in range(len(calls)))}"]
    for i, (name, schema) in enumerate(calls):
        document = {**_document(schema), "x-guidance": _options(compact=True)}
        prefix = json.dumps('{"name":' + json.dumps(name) + ',"arguments":')
        rules.append(f'call_{i}: {prefix} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(document, ensure_ascii=False)}")
    return _checked(spec, llg.LLMatcher.grammar_from_lark("\n".join(rules) + "\n"))


def _checked(spec: TokenizerSpec, grammar: str) -> CompiledLLG:
    tok = tokenizer(spec)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=LIMITS)
    if is_error:
        raise Refused(_reason(messages[0] if messages else "llguidance refused the grammar"))
    return CompiledLLG(tok, grammar, spec.stop_token_ids)


def _reason(message: str) -> str:
    """llguidance's reason, without the Lark source excerpt it adds for inline schemas."""
    line = _first_line(message)
    return line.split("failed to compile JSON schema: ", 1)[-1]


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


class LLGState:
    """One generation's parse state, with the methods of xgrammar's GrammarMatcher that
    host.grammar.Matcher calls."""

    def __init__(self, compiled: CompiledLLG, matcher: llg.LLMatcher, stopped: bool = False) -> None:
        self._compiled = compiled
        self._matcher = matcher
        self._stops = frozenset(compiled.stop_token_ids)
        # Set by accepting a stop token (nothing can follow one): llguidance's own is_stopped()
        # also turns true when nothing but a stop can follow, before it is taken.
        self._stopped = stopped

    def accept_token(self, token_id: int) -> bool:
        if self._stopped:
            return False
        if token_id in self._stops:
            # Taken only where the grammar may end (consume_token would enter llguidance's
            # permanent error state otherwise; try_consume_tokens never takes a stop token).
            self._stopped = bool(self._matcher.is_accepting()) and bool(self._matcher.consume_token(token_id))
            return self._stopped
        # try_consume_tokens refuses without entering the error state.
        if self._matcher.try_consume_tokens([token_id]) != 1:
            return False
        if not self._stops:  # nothing to end on: end where the grammar allows nothing more
            self._stopped = bool(self._matcher.is_accepting()) and bool(self._matcher.is_stopped())
        return True

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        self._stopped = False  # a stop token is always the last one accepted

    def is_terminated(self) -> bool:
        return self._stopped

    def is_completed(self) -> bool:
        return bool(self._matcher.is_accepting())

    def fill_next_token_bitmask(self, out: npt.NDArray[np.int32]) -> bool:
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance: {_first_line(self._matcher.get_error())}")
        return not bool(np.all(out == -1))

    def find_jump_forward_string(self) -> str:
        forced = self._matcher.compute_ff_bytes()
        # Cut a trailing partial UTF-8 character: the text must decode on its own.
        for cut in range(len(forced), max(len(forced) - 4, -1), -1):
            try:
                return forced[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""

    def reset(self) -> None:
        self._matcher.reset()
        self._stopped = False

    def fork(self) -> LLGState:
        return LLGState(self._compiled, self._matcher.deep_copy(), self._stopped)
