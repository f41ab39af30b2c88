"""Compiles grammars for one tokenizer and caches them by (kind, text, options) in an LRU.

Thread-safe: inferlet threads share one compiler. Knows the grammar kinds and their options;
the JSON schema and tool-call specifics live in schema_support and tool_call.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import xgrammar as xgr

from host.grammar import schema_support, tool_call
from host.grammar.errors import (
    InvalidEBNF,
    InvalidGrammar,
    InvalidJSONSchema,
    InvalidRegex,
    InvalidToolCall,
    UnsupportedSchema,
)
from host.grammar.grammar import KINDS, Grammar, GrammarKey, OptionItems
from host.grammar.json_grammar import json_schema_grammar
from host.grammar.tokenizer_info import TokenizerSpec, token_table, tokenizer_info
from host.grammar.utf8_guard import Utf8Guard

Option = bool | str | int
# Each kind's options and their defaults; anything else is refused, so a typo is not ignored.
OPTIONS: dict[str, dict[str, Option]] = {
    "json_object": {"compact": True},
    "json": {"compact": True},
    "json_schema": {"strict": True, "compact": True, "reject_unsupported": False, "max_length_limit": 32},
    "regex": {},
    "ebnf": {"root": "root"},
    "tool_call": {
        "choice": "required",
        "strict": True,
        "reject_unsupported": False,
        "max_length_limit": 32,
        "call_begin": tool_call.DEFAULT_CALL_BEGIN,
        "call_end": tool_call.DEFAULT_CALL_END,
    },
}
_ERRORS: dict[str, Callable[[str], InvalidGrammar]] = {
    "json_object": InvalidJSONSchema,
    "json": InvalidJSONSchema,
    "json_schema": InvalidJSONSchema,
    "regex": InvalidRegex,
    "ebnf": InvalidEBNF,
    "tool_call": InvalidToolCall,
}
# Sizes past which a grammar is refused before it is compiled. Compile time grows fast with them
# (measured with xgrammar 0.2.8: arrays nested 400 deep took 2.4 s, 800 deep over a minute; a
# 1 MB regex about a minute), and a compile cannot be interrupted: these keep one under a second.
MAX_GRAMMAR_CHARS = {"regex": 16 * 1024, "ebnf": 256 * 1024, "json_schema": 1024 * 1024, "tool_call": 1024 * 1024}
MAX_PATTERN_CHARS = 16 * 1024  # a schema's `pattern` (and `patternProperties` keys)
MAX_SCHEMA_DEPTH = 128  # nesting of the schema document (objects and arrays)
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a failed check.
_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    """One per tokenizer (per driver). Grammars it returns are immutable and may be shared."""

    def __init__(self, tokenizer: TokenizerSpec, *, cache_size: int = 256, max_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        info = tokenizer_info(tokenizer)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._utf8_guard = Utf8Guard.from_table(token_table(tokenizer))
        self._cache: OrderedDict[GrammarKey, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    # ------------------------------------------------------------ the kinds, one method each

    def json_object(self, *, compact: bool = True) -> Grammar:
        """Any JSON object (compact: no whitespace outside strings)."""
        return self.compile("json_object", "", {"compact": compact})

    def json_value(self, *, compact: bool = True) -> Grammar:
        """Any JSON value."""
        return self.compile("json", "", {"compact": compact})

    def json_schema(
        self,
        schema: str | Mapping[str, Any] | bool,
        *,
        strict: bool = True,
        compact: bool = True,
        reject_unsupported: bool = False,
        max_length_limit: int = 32,
    ) -> Grammar:
        """Output valid against `schema`. `strict`: properties and items the schema does not
        declare are refused (even where the schema would allow them). `reject_unsupported`:
        raise UnsupportedSchema instead of compiling keywords the engine does not enforce.
        `max_length_limit`: string maxLength bounds above it are not enforced (listed in
        `unsupported`), because each costs seconds to compile."""
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        options = {
            "strict": strict,
            "compact": compact,
            "reject_unsupported": reject_unsupported,
            "max_length_limit": max_length_limit,
        }
        return self.compile("json_schema", text, options)

    def regex(self, pattern: str) -> Grammar:
        return self.compile("regex", pattern)

    def ebnf(self, text: str, *, root: str = "root") -> Grammar:
        """xgrammar's EBNF (GBNF-like): `root ::= "yes" | "no"`."""
        return self.compile("ebnf", text, {"root": root})

    def tool_call(
        self, tools: str | list[Any], *, choice: str = "required", strict: bool = True, **options: Option
    ) -> Grammar:
        """`choice`: a tool's name (forced), "required" (one call of any tool), or "auto".
        Other options (OPTIONS["tool_call"]): reject_unsupported, max_length_limit, call_begin,
        call_end."""
        parsed = tool_call.parse_tools(tools)
        merged = {**options, "choice": choice, "strict": strict}
        return self.compile("tool_call", tool_call.canonical_tools(parsed), merged)

    # ------------------------------------------------------------ generic entry and cache

    def compile(self, kind: str, text: str, options: Mapping[str, Option] | None = None) -> Grammar:
        """Compile (or fetch from the cache) a grammar of `kind`; see OPTIONS for each kind's options."""
        key = GrammarKey(kind, text, _option_items(kind, options or {}))
        limit = MAX_GRAMMAR_CHARS.get(kind)
        if limit is not None and len(text) > limit:
            raise _ERRORS[kind](f"the grammar is {len(text)} characters, more than the {limit} this host compiles")
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return cached
            self.num_misses += 1
        # Compiled outside the lock: a slow schema must not hold up every other run. Two threads
        # compiling the same key both succeed; the first one stored is kept.
        grammar = self._build(key)
        with self._lock:
            grammar = self._cache.setdefault(key, grammar)
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def _build(self, key: GrammarKey) -> Grammar:
        options = dict(key.options)
        start = time.perf_counter()
        unsupported: tuple[str, ...] = ()
        try:
            if key.kind == "json_schema":
                compiled, unsupported = self._json_schema(key.text, options)
            elif key.kind in ("json_object", "json"):
                schema = '{"type":"object"}' if key.kind == "json_object" else "{}"
                compiled = self._compile_json(schema, strict=False, compact=bool(options["compact"]))
            elif key.kind == "regex":
                compiled = self._compiler.compile_regex(key.text)
            elif key.kind == "ebnf":
                compiled = self._compiler.compile_grammar(key.text, root_rule_name=str(options["root"]))
            else:
                compiled, unsupported = self._tool_call(key.text, options)
        except InvalidGrammar:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/pydantic errors alike
            raise _ERRORS[key.kind](_engine_message(exc)) from None
        return Grammar(
            key,
            compiled,
            self.tokenizer.vocab_size,
            self.tokenizer.stop_token_ids,
            unsupported,
            time.perf_counter() - start,
            self._utf8_guard,
        )

    def _compile_json(self, schema: str, *, strict: bool, compact: bool) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(json_schema_grammar(schema, strict=strict, compact=compact))

    def _json_schema(self, text: str, options: dict[str, Option]) -> tuple[xgr.CompiledGrammar, tuple[str, ...]]:
        schema = _parse_schema(text, InvalidJSONSchema)
        schema, relaxed = schema_support.relax_max_length(schema, int(options["max_length_limit"]))
        unsupported = tuple(sorted(schema_support.unsupported_features(schema, bool(options["strict"])) + relaxed))
        if unsupported and options["reject_unsupported"]:
            raise UnsupportedSchema(unsupported)
        normalized = json.dumps(schema, ensure_ascii=False)
        compiled = self._compile_json(normalized, strict=bool(options["strict"]), compact=bool(options["compact"]))
        return compiled, unsupported

    def _tool_call(self, text: str, options: dict[str, Option]) -> tuple[xgr.CompiledGrammar, tuple[str, ...]]:
        chosen = tool_call.select(tool_call.parse_tools(text), str(options["choice"]))
        strict = bool(options["strict"])
        arguments: list[xgr.Grammar] = []
        unsupported: list[str] = []
        for tool in chosen:
            check_schema_size(tool.parameters, InvalidToolCall)
            schema = schema_support.normalize(tool.parameters)
            schema, relaxed = schema_support.relax_max_length(schema, int(options["max_length_limit"]))
            features = schema_support.unsupported_features(schema, strict) + relaxed
            unsupported += [f"{f} in tool {tool.name!r}" for f in features]
            arguments.append(json_schema_grammar(json.dumps(schema, ensure_ascii=False), strict=strict, compact=True))
        if unsupported and options["reject_unsupported"]:
            raise UnsupportedSchema(tuple(unsupported))
        if options["choice"] == "auto":
            tag = tool_call.auto_structural_tag(chosen, arguments, str(options["call_begin"]), str(options["call_end"]))
            return self._compiler.compile_structural_tag(tag), tuple(unsupported)
        calls = [tool_call.call_grammar(tool, args) for tool, args in zip(chosen, arguments, strict=True)]
        return self._compiler.compile_grammar(tool_call.required_grammar(calls)), tuple(unsupported)


def _option_items(kind: str, options: Mapping[str, Option]) -> OptionItems:
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
    return tuple(sorted(merged.items()))


def _parse_schema(text: str, error: Callable[[str], InvalidGrammar]) -> Any:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise error(f"the schema is not valid JSON: {exc}") from None
    except RecursionError:
        raise error(f"the schema nests deeper than the {MAX_SCHEMA_DEPTH} levels this host compiles") from None
    if not isinstance(schema, dict | bool):
        raise error(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    check_schema_size(schema, error)
    return schema_support.normalize(schema)


def check_schema_size(schema: Any, error: Callable[[str], InvalidGrammar]) -> None:
    """Refuse a schema nested deeper than MAX_SCHEMA_DEPTH or with a pattern longer than
    MAX_PATTERN_CHARS, naming where (iterative: a deep document must not exhaust the stack)."""
    stack: list[tuple[Any, str, int]] = [(schema, "", 1)]
    while stack:
        node, pointer, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise error(f"the schema nests deeper than the {MAX_SCHEMA_DEPTH} levels this host compiles (at {pointer})")
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{pointer}/{key}"
                if key == "pattern" and isinstance(value, str) and len(value) > MAX_PATTERN_CHARS:
                    raise error(
                        f"the pattern at {path} is longer than the {MAX_PATTERN_CHARS} characters this host compiles"
                    )
                if key == "patternProperties" and isinstance(value, dict):
                    for name in value:
                        if len(name) > MAX_PATTERN_CHARS:
                            raise error(
                                f"a patternProperties pattern at {path} is longer than {MAX_PATTERN_CHARS} characters"
                            )
                stack.append((value, path, depth + 1))
        elif isinstance(node, list):
            stack.extend((value, f"{pointer}/{i}", depth + 1) for i, value in enumerate(node))


def _engine_message(exc: Exception) -> str:
    lines = [_ENGINE_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    message = " ".join(line for line in lines if line) or type(exc).__name__
    return message if len(message) <= 500 else message[:497] + "..."
