"""Compiles grammars for one tokenizer and caches them by (kind, text, options) in an LRU.

Thread-safe: inferlet threads share one compiler. Owns an entry point per kind, the compile
budget, the workers and the cache; `options` checks the options, `limits` the sizes, and
`builder` picks the engine and compiles (not knowing the cache).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from host.grammar import tool_call
from host.grammar.builder import GrammarBuilder
from host.grammar.errors import CompileBudgetExceeded, GrammarTooLarge
from host.grammar.grammar import Grammar, GrammarKey
from host.grammar.limits import check_grammar_size
from host.grammar.options import Option, option_items
from host.grammar.tokenizer_info import TokenizerSpec
from host.waiting import result_in_slices

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
        self._builder = GrammarBuilder(tokenizer, max_threads=max_threads)
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
        `backend`: one of BACKENDS (host.grammar.options). A `format` the draft's format checker
        does not know is an annotation (a plain string), as JSON Schema reads it."""
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
        Other options (OPTIONS["tool_call"] in host.grammar.options): reject_unsupported,
        max_length_limit, call_begin, call_end."""
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
        """Compile (or fetch from the cache) a grammar of `kind`; see OPTIONS (host.grammar.options)
        for each kind's options. `may_wait` is called while waiting (host.waiting.SLICE_S); what it raises ends the wait
        (a run that was cancelled or ran out of time, say)."""
        key = GrammarKey(kind, text, option_items(kind, options or {}))
        check_grammar_size(kind, text)
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
        return self._builder.build(key)
