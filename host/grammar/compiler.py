"""Compiles grammars for one tokenizer and caches them by (kind, text, options) in an LRU.

Thread-safe: inferlet threads share one compiler. Owns an entry point per kind, the compile
budget, the workers, each owner's share of them and the cache; `options` checks the options,
`limits` the sizes, `builder` picks the engine and compiles (not knowing the cache), and
`compile_process` runs a compile where it can be killed.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from host.grammar import compile_process, tool_call
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

    A compile takes one of `compile_workers` workers, and at most `compiles_per_owner` of them
    go to one owner (an API key, a run: whoever `compile` names) at once, so one owner cannot
    take them all (default: all but one). A compile longer than `compile_budget_s` (0: no
    limit), its wait for a worker included, is refused with CompileBudgetExceeded.

    Once compiles come from a second owner or one outran its budget (or `isolate_compiles` is
    called), each is first made in a child process (host.grammar.compile_process), killed at
    the budget, which frees its worker; one that finishes there is rebuilt here (llguidance's
    from its text, xgrammar's compiled again: see GrammarBuilder.portable), so a caller waits
    up to twice the budget. Before that (one owner alone has no one to be fair to, and a CLI
    run need not start the helper), or with `compile_in_child` off, compiles run on threads
    here: one past its budget goes on in the background, holding its worker and its owner's
    share, and is cached. Callers asking for a grammar already being compiled wait for that
    one compile."""

    def __init__(
        self,
        tokenizer: TokenizerSpec,
        *,
        cache_size: int = 256,
        max_threads: int = 2,
        compile_budget_s: float = DEFAULT_COMPILE_BUDGET_S,
        compile_workers: int = 2,
        compiles_per_owner: int | None = None,
        max_grammar_mib: float = DEFAULT_MAX_GRAMMAR_MIB,
        cache_mib: float = DEFAULT_CACHE_MIB,
        compile_in_child: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.compile_budget_s = compile_budget_s
        self.max_grammar_bytes = int(max_grammar_mib * MIB)
        self._cache_bytes_limit = int(cache_mib * MIB)
        self._cache_bytes = 0
        num_workers = max(1, compile_workers)
        self._workers = threading.BoundedSemaphore(num_workers)
        self.compiles_per_owner = max(1, num_workers - 1 if compiles_per_owner is None else compiles_per_owner)
        self._owner_compiles: dict[str, int] = {}  # owner -> compiles it has started and not ended
        self._owners_changed = threading.Condition()
        self._first_owner: str | None = None
        self._in_flight: dict[GrammarKey, concurrent.futures.Future[Grammar]] = {}
        self._max_threads = max_threads
        self._builder = GrammarBuilder(tokenizer, max_threads=max_threads)
        self._processes = compile_process.shared() if compile_in_child else None
        self._is_isolating = False
        self._cache: OrderedDict[GrammarKey, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    @property
    def is_isolating(self) -> bool:
        """Whether compiles go to child processes (when the helper is ready)."""
        return self._is_isolating

    def isolate_compiles(self) -> None:
        """Compile in child processes from now on (once the helper is ready, a few seconds
        after it is first asked for: until then, here)."""
        if self._processes is not None:
            self._is_isolating = True
            self._processes.prepare(self.tokenizer, self._max_threads)

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
        owner: str | None = None,
    ) -> Grammar:
        """Compile (or fetch from the cache) a grammar of `kind`; see OPTIONS (host.grammar.options)
        for each kind's options. `may_wait` is called while waiting (host.waiting.SLICE_S); what it raises ends the wait
        (a run that was cancelled or ran out of time, say). `owner` (an API key, a run) gets at
        most `compiles_per_owner` workers at once; None: no share of its own (trusted callers)."""
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
            starts = future is None
            if future is None:
                future = self._in_flight[key] = concurrent.futures.Future()
        if starts:
            self._note_owner(owner)
            self._start(key, future, owner)
        return self._wait(key, future, may_wait)

    def _note_owner(self, owner: str | None) -> None:
        """Isolate compiles once a second owner compiles (others may then wait for workers)."""
        if owner is None or self._is_isolating:
            return
        with self._lock:
            first, self._first_owner = self._first_owner, self._first_owner or owner
        if first is not None and first != owner:
            self.isolate_compiles()

    def _start(self, key: GrammarKey, future: concurrent.futures.Future[Grammar], owner: str | None) -> None:
        """Compile `key` on a thread of its own once its owner's share and a worker are free
        (daemon threads: a compile left running never holds up the process's exit)."""
        budget = self.compile_budget_s
        deadline_s = time.monotonic() + budget if budget > 0 else None

        def fail(exc: BaseException) -> None:  # handed to every waiter
            with self._lock:
                self._in_flight.pop(key, None)
            future.set_exception(exc)

        def work() -> None:
            # No share or worker free before the deadline: given up, so a flood of slow grammars
            # cannot queue more compiling than the workers do in one budget. The owner's share
            # is taken first: an owner waiting for its own compiles holds no worker meanwhile.
            if not self._take_share(owner, deadline_s):
                fail(CompileBudgetExceeded(key.kind, budget))
                return
            try:
                if not self._workers.acquire(timeout=_left(deadline_s)):
                    fail(CompileBudgetExceeded(key.kind, budget))
                    return
                try:
                    grammar = self._build(key, deadline_s)
                finally:
                    self._workers.release()
            except CompileBudgetExceeded:
                fail(CompileBudgetExceeded(key.kind, budget))  # (the child's carries no budget)
                return
            except BaseException as exc:
                fail(exc)
                return
            finally:
                self._give_back_share(owner)
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

    def _take_share(self, owner: str | None, deadline_s: float | None) -> bool:
        """One of `owner`'s compiles starts, once it has fewer than its share running; False
        if that did not happen before `deadline_s`."""
        if owner is None:
            return True
        with self._owners_changed:
            while self._owner_compiles.get(owner, 0) >= self.compiles_per_owner:
                left = _left(deadline_s)
                if left is not None and left <= 0:
                    return False
                self._owners_changed.wait(left)
            self._owner_compiles[owner] = self._owner_compiles.get(owner, 0) + 1
            return True

    def _give_back_share(self, owner: str | None) -> None:
        if owner is None:
            return
        with self._owners_changed:
            left = self._owner_compiles.pop(owner) - 1
            if left:
                self._owner_compiles[owner] = left
            self._owners_changed.notify_all()

    def _wait(
        self, key: GrammarKey, future: concurrent.futures.Future[Grammar], may_wait: Callable[[], None] | None
    ) -> Grammar:
        budget = self.compile_budget_s
        # Isolated, a compile that passed in its child may be compiled again here (see the class).
        wait_s = budget * (2 if self._is_isolating else 1) if budget > 0 else None
        try:
            return result_in_slices(future, may_wait, wait_s)
        except concurrent.futures.TimeoutError:
            self.isolate_compiles()  # a compile here outran the budget: the next ones can be killed
            raise CompileBudgetExceeded(key.kind, budget) from None

    def cache_len(self) -> int:
        with self._lock:
            return len(self._cache)

    def cache_bytes(self) -> int:
        """Memory the cached grammars hold (see Grammar.memory_bytes)."""
        with self._lock:
            return self._cache_bytes

    def _build(self, key: GrammarKey, deadline_s: float | None) -> Grammar:
        """Compile `key`: isolated, first in a child process killed at `deadline_s`
        (time.monotonic); here when not isolated or the helper is not ready."""
        processes = self._processes
        if not self._is_isolating or processes is None:
            return self._builder.build(key)
        if not processes.is_ready_for(self.tokenizer, self._max_threads):
            processes.prepare(self.tokenizer, self._max_threads)  # (nothing when it is under way)
            return self._builder.build(key)
        try:
            done = processes.compile((self.tokenizer, self._max_threads), key, self.max_grammar_bytes, deadline_s)
        except OSError:  # the helper is gone: compile here while another one starts
            processes.prepare(self.tokenizer, self._max_threads)
            return self._builder.build(key)
        if done.payload:
            return self._builder.rebuild(key, done.payload, done.unsupported, done.compile_time_s)
        return self._builder.build(key)  # it finished within the budget in the child


def _left(deadline_s: float | None) -> float | None:
    """Seconds to `deadline_s` (time.monotonic; None: no deadline), at least 0."""
    return None if deadline_s is None else max(0.0, deadline_s - time.monotonic())
