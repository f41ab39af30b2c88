"""Compiles grammars for one tokenizer and caches them by (kind, text, options) in an LRU.

Thread-safe: inferlet threads share one compiler. Knows the grammar kinds and their options,
and which engine compiles a JSON schema (BACKENDS); the JSON schema and tool-call specifics
live in schema_support and tool_call, llguidance's in llg_backend.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import xgrammar as xgr

from host.grammar import llg_backend, schema_support, tool_call
from host.grammar.errors import (
    CompileBudgetExceeded,
    GrammarTooLarge,
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
from host.waiting import result_in_slices

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
# Which engine compiles a JSON schema. "auto": xgrammar when it enforces every keyword and its
# compile is cheap (strict mode, no string bound above XGRAMMAR_CHEAP_MAX_LENGTH), else
# llguidance; when llguidance refuses, xgrammar after all (it may then be slow, or leave
# keywords unenforced). Measured on the 133-schema corpus with SmolLM2: xgrammar's non-strict
# compiles took over a second for 30 schemas (up to 48 s), llguidance's 17 ms at most.
BACKENDS = ("auto", "xgrammar", "llguidance")
XGRAMMAR_CHEAP_MAX_LENGTH = 32
_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


DEFAULT_COMPILE_BUDGET_S = 10.0
MIB = 1024 * 1024
# Compiled grammars on SmolLM2's tokenizer (xgrammar's count, the 133 corpus schemas): median
# 67 KiB, largest 16 MiB.
DEFAULT_MAX_GRAMMAR_MIB = 64
DEFAULT_CACHE_MIB = 512


class GrammarCompiler:
    """One per tokenizer (per driver). Grammars it returns are immutable and may be shared.

    Compiles run on their own threads, at most `compile_workers` at once, and a caller waits at
    most `compile_budget_s` (0: no limit) for one: past it CompileBudgetExceeded is raised. A
    compile cannot be interrupted, so it finishes in the background and is cached (a retry may
    find it); the worker limit bounds the CPU such compiles take. Callers asking for a grammar
    already being compiled wait for that one compile."""

    def __init__(
        self,
        tokenizer: TokenizerSpec,
        *,
        cache_size: int = 256,
        max_threads: int = 2,
        compile_budget_s: float = DEFAULT_COMPILE_BUDGET_S,
        compile_workers: int = 2,
        max_grammar_mib: float = DEFAULT_MAX_GRAMMAR_MIB,
        cache_mib: float = DEFAULT_CACHE_MIB,
    ) -> None:
        self.tokenizer = tokenizer
        self.compile_budget_s = compile_budget_s
        self.max_grammar_bytes = int(max_grammar_mib * MIB)
        self._cache_bytes_limit = int(cache_mib * MIB)
        self._cache_bytes = 0
        self._workers = threading.BoundedSemaphore(max(1, compile_workers))
        self._in_flight: dict[GrammarKey, concurrent.futures.Future[Grammar]] = {}
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
        backend: str = "auto",
    ) -> Grammar:
        """Output valid against `schema`. `strict`: properties and items the schema does not
        declare are refused (even where the schema would allow them, as OpenAI's strict mode).
        `reject_unsupported`: raise UnsupportedSchema instead of compiling keywords no engine
        enforces. `max_length_limit`: on xgrammar, string maxLength bounds above it are not
        enforced (listed in `unsupported`), because each costs seconds to compile there.
        `backend`: one of BACKENDS. A `format` the draft's format checker does not know is an
        annotation (a plain string), as JSON Schema reads it."""
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        options: dict[str, Option] = {
            "strict": strict,
            "compact": compact,
            "reject_unsupported": reject_unsupported,
            "max_length_limit": max_length_limit,
            "backend": backend,
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

    def compile(
        self,
        kind: str,
        text: str,
        options: Mapping[str, Option] | None = None,
        *,
        may_wait: Callable[[], None] | None = None,
    ) -> Grammar:
        """Compile (or fetch from the cache) a grammar of `kind`; see OPTIONS for each kind's
        options. `may_wait` is called while waiting (host.waiting.SLICE_S); what it raises ends the wait
        (a run that was cancelled or ran out of time, say)."""
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
            future = self._in_flight.get(key)
            owner = future is None
            if future is None:
                future = self._in_flight[key] = concurrent.futures.Future()
        if owner:
            self._start(key, future)
        return self._wait(key, future, may_wait)

    def _start(self, key: GrammarKey, future: concurrent.futures.Future[Grammar]) -> None:
        """Compile `key` on a thread of its own once a worker is free (daemon threads: a compile
        left running never holds up the process's exit)."""

        def fail(exc: BaseException) -> None:  # handed to every waiter
            with self._lock:
                self._in_flight.pop(key, None)
            future.set_exception(exc)

        def work() -> None:
            # No free worker within the budget: given up, so a flood of slow grammars cannot
            # queue more compiling than the workers do in one budget.
            budget = self.compile_budget_s
            if not self._workers.acquire(timeout=budget if budget > 0 else None):
                fail(CompileBudgetExceeded(key.kind, budget))
                return
            try:
                grammar = self._build(key)
            except BaseException as exc:
                fail(exc)
                return
            finally:
                self._workers.release()
            if grammar.memory_bytes > self.max_grammar_bytes:
                fail(GrammarTooLarge(key.kind, grammar.memory_bytes, self.max_grammar_bytes))
                return
            with self._lock:
                if key not in self._cache:
                    self._cache[key] = grammar
                    self._cache_bytes += grammar.memory_bytes
                grammar = self._cache[key]
                self._cache.move_to_end(key)
                while len(self._cache) > 1 and (
                    len(self._cache) > self._cache_size or self._cache_bytes > self._cache_bytes_limit
                ):
                    _, dropped = self._cache.popitem(last=False)
                    self._cache_bytes -= dropped.memory_bytes
                self._in_flight.pop(key, None)
            future.set_result(grammar)

        threading.Thread(target=work, name="grammar-compile", daemon=True).start()

    def _wait(
        self, key: GrammarKey, future: concurrent.futures.Future[Grammar], may_wait: Callable[[], None] | None
    ) -> Grammar:
        budget = self.compile_budget_s
        try:
            return result_in_slices(future, may_wait, budget if budget > 0 else None)
        except concurrent.futures.TimeoutError:
            raise CompileBudgetExceeded(key.kind, budget) from None

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def cache_bytes(self) -> int:
        """Memory the cached grammars hold (see Grammar.memory_bytes)."""
        with self._lock:
            return self._cache_bytes

    def _build(self, key: GrammarKey) -> Grammar:
        options = dict(key.options)
        start = time.perf_counter()
        unsupported: tuple[str, ...] = ()
        compiled: xgr.CompiledGrammar | llg_backend.CompiledLLG
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
            llg_backend.BACKEND if isinstance(compiled, llg_backend.CompiledLLG) else "xgrammar",
        )

    def _compile_json(self, schema: str, *, strict: bool, compact: bool) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(json_schema_grammar(schema, strict=strict, compact=compact))

    def _json_schema(
        self, text: str, options: dict[str, Option]
    ) -> tuple[xgr.CompiledGrammar | llg_backend.CompiledLLG, tuple[str, ...]]:
        backend = str(options["backend"])
        strict, compact = bool(options["strict"]), bool(options["compact"])
        schema, features = _prepared(_parse_schema(text, InvalidJSONSchema), strict)
        if backend == "auto" and strict and _cheap(schema, features):
            return self._compile_json(json.dumps(schema, ensure_ascii=False), strict=True, compact=compact), ()
        refusal = ""
        if backend in ("auto", "llguidance"):
            try:
                closed = schema_support.close_objects(schema) if strict else schema
                return llg_backend.compile_json_schema(self.tokenizer, closed, compact=compact), ()
            except llg_backend.Refused as exc:
                if backend == "llguidance":
                    raise UnsupportedSchema((), str(exc)) from None
                refusal = str(exc)
        schema, relaxed = schema_support.relax_max_length(schema, int(options["max_length_limit"]))
        unsupported = tuple(sorted(features + relaxed))
        if unsupported and options["reject_unsupported"]:
            raise UnsupportedSchema(unsupported, refusal)
        normalized = json.dumps(schema, ensure_ascii=False)
        return self._compile_json(normalized, strict=strict, compact=compact), unsupported

    def _tool_call(
        self, text: str, options: dict[str, Option]
    ) -> tuple[xgr.CompiledGrammar | llg_backend.CompiledLLG, tuple[str, ...]]:
        chosen = tool_call.select(tool_call.parse_tools(text), str(options["choice"]))
        strict, backend, choice = bool(options["strict"]), str(options["backend"]), str(options["choice"])
        prepared: list[tuple[tool_call.Tool, Any, tuple[str, ...]]] = []
        for tool in chosen:
            check_schema_size(tool.parameters, InvalidToolCall)
            schema, features = _prepared(schema_support.normalize(tool.parameters), strict)
            prepared.append((tool, schema, features))
        # Free text with calls in it ("auto") is xgrammar's structural tag; llguidance serves
        # forced and required calls, where xgrammar would leave a keyword unenforced or be slow.
        refusal = ""
        if backend == "llguidance" and choice == "auto":
            raise InvalidToolCall("llguidance serves forced and required calls; choice 'auto' needs xgrammar")
        all_cheap = all(_cheap(schema, features) for _, schema, features in prepared)
        if backend == "llguidance" or (backend == "auto" and choice != "auto" and not all_cheap):
            calls = [(t.name, schema_support.close_objects(schema) if strict else schema) for t, schema, _ in prepared]
            try:
                return llg_backend.compile_tool_calls(self.tokenizer, calls), ()
            except llg_backend.Refused as exc:
                if backend == "llguidance":
                    raise UnsupportedSchema((), str(exc)) from None
                refusal = str(exc)
        arguments: list[xgr.Grammar] = []
        unsupported: list[str] = []
        for tool, schema, features in prepared:
            schema, relaxed = schema_support.relax_max_length(schema, int(options["max_length_limit"]))
            unsupported += [f"{f} in tool {tool.name!r}" for f in features + relaxed]
            arguments.append(json_schema_grammar(json.dumps(schema, ensure_ascii=False), strict=strict, compact=True))
        if unsupported and options["reject_unsupported"]:
            raise UnsupportedSchema(tuple(unsupported), refusal)
        if choice == "auto":
            tag = tool_call.auto_structural_tag(chosen, arguments, str(options["call_begin"]), str(options["call_end"]))
            return self._compiler.compile_structural_tag(tag), tuple(unsupported)
        calls_ = [tool_call.call_grammar(tool, args) for tool, args in zip(chosen, arguments, strict=True)]
        return self._compiler.compile_grammar(tool_call.required_grammar(calls_)), tuple(unsupported)


def _prepared(schema: Any, strict: bool) -> tuple[Any, tuple[str, ...]]:
    """A normalized schema as both engines get it (formats no validator checks dropped, oneOf
    proved exclusive as anyOf), and what xgrammar would not enforce, in the schema's own words."""
    if schema_support.has_format(schema):  # (only then is jsonschema, slow to import, needed)
        schema, _annotations = schema_support.drop_annotation_formats(schema, schema_support.checked_formats(schema))
    features = schema_support.unsupported_features(schema, strict)
    return schema_support.exclusive_one_of_as_any_of(schema), features


def _cheap(schema: Any, features: tuple[str, ...]) -> bool:
    """xgrammar enforces all of `schema` and compiles it quickly (no long maxLength)."""
    return not features and not schema_support.relax_max_length(schema, XGRAMMAR_CHEAP_MAX_LENGTH)[1]


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
    if "backend" in merged and merged["backend"] not in BACKENDS:
        raise _ERRORS[kind](f"unknown backend {merged['backend']!r}; expected one of {', '.join(BACKENDS)}")
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
