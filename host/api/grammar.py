"""`wafer:inferlet/grammar`: the `grammar` and `matcher` resources over `host.grammar`, and what
one run may hold of them.

Grammars compile through the engine's compiler (one per driver, cached); matchers live here, on
the host, and `forward-pass.use-matcher` fills a row's logit mask from one when its pass runs.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import TYPE_CHECKING, cast

import wasmtime
from wasmtime.component import LinkerInstance, ResourceAny, ResourceHost, ResourceType

from host.api.host_call import borrowed_rep, error_text, host_function
from host.errors import HostError
from host.sandbox.config import RunHostLimits
from host.sandbox.outcome import RunStatus
from host.sandbox.resources import ResourceKind, ResourceTable
from host.sandbox.run_state import RunState, current_or_none

if TYPE_CHECKING:  # host.grammar imports xgrammar (and torch): only runs that use grammars pay
    from host.grammar import Grammar, Matcher

INTERFACE = "grammar"

# WIT kinds are kebab-case; host.grammar's are snake_case.
_KINDS = {
    "json-object": "json_object",
    "json": "json",
    "json-schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "tool-call": "tool_call",
}


class _RunHoldings:
    """What one run holds through this interface, checked against its `RunHostLimits` (host
    memory outside its memory cap; grammar handles keep their compiled grammar alive after the
    shared cache dropped it, so the distinct grammars a run holds are bounded by bytes too)."""

    def __init__(self, limits: RunHostLimits) -> None:
        from host.grammar.history import HistoryBudget

        self.limits = limits
        self.history = HistoryBudget(limits.matcher_tokens)
        self.num_matchers = 0
        self.num_grammars = 0
        self.grammar_bytes = 0  # of the distinct grammars behind the handles
        self._handles_of: dict[int, int] = {}  # id(grammar) -> the run's live handles to it

    def grammars_full(self) -> str | None:
        """The error text when the run may take no more grammar handles, else None."""
        if self.num_grammars < self.limits.grammars:
            return None
        return (
            f"grammar limit exceeded: the run holds {self.num_grammars} grammars, the most a run may; "
            "drop grammars you are done with"
        )

    def take_grammar(self, grammar: Grammar) -> str | None:
        """Count a new handle to `grammar`; the error text (nothing counted) past a bound."""
        if (full := self.grammars_full()) is not None:
            return full
        is_new = id(grammar) not in self._handles_of
        if is_new and self.grammar_bytes + grammar.memory_bytes > self.limits.grammar_bytes:
            return (
                f"grammar limit exceeded: the run's grammars would take {self.grammar_bytes + grammar.memory_bytes} "
                f"bytes, more than the {self.limits.grammar_bytes} a run may hold; drop grammars you are done with"
            )
        self._handles_of[id(grammar)] = self._handles_of.get(id(grammar), 0) + 1
        self.grammar_bytes += grammar.memory_bytes if is_new else 0
        self.num_grammars += 1
        return None

    def drop_grammar(self, grammar: Grammar) -> None:
        left = self._handles_of.pop(id(grammar)) - 1
        if left:
            self._handles_of[id(grammar)] = left
        else:
            self.grammar_bytes -= grammar.memory_bytes
        self.num_grammars -= 1

    def check_matcher_room(self, run: RunState) -> None:
        """Before a new matcher: past the bound the run ends (a constructor has no error result)."""
        if self.num_matchers >= self.limits.matchers:
            raise run.stop(
                f"grammar limit exceeded: the run holds {self.num_matchers} matchers, the most a run may "
                "(release matchers you are done with)",
                RunStatus.LIMIT_EXCEEDED,
            )


# Keyed by the run's resource table (RunState cannot be weakly referenced): gone with the run.
_holdings: weakref.WeakKeyDictionary[ResourceTable, _RunHoldings] = weakref.WeakKeyDictionary()
_holdings_lock = threading.Lock()


def _holdings_of(run: RunState) -> _RunHoldings:
    with _holdings_lock:
        held = _holdings.get(run.resources)
        if held is None:
            held = _holdings[run.resources] = _RunHoldings(run.config.host_limits)
        return held


def _limit_stop(run: RunState, exc: HostError) -> wasmtime.WasmtimeError:
    """The run ends with `exc`'s message (a bound it passed) as its reason."""
    return run.stop(error_text(exc), RunStatus.LIMIT_EXCEEDED)


def matcher_by_rep(run: RunState, rep: int) -> Matcher:
    return cast("Matcher", run.resources.get(ResourceKind.MATCHER, rep))


def _grammar(run: RunState, handle: ResourceAny) -> Grammar:
    return cast("Grammar", run.resources.get(ResourceKind.GRAMMAR, borrowed_rep(run, handle)))


def _matcher(run: RunState, handle: ResourceAny) -> Matcher:
    return matcher_by_rep(run, borrowed_rep(run, handle))


@host_function
def compile_grammar(run: RunState, kind: str, text: str, options: str) -> ResourceHost | str:
    if kind not in _KINDS:
        return f"unknown grammar kind {kind!r}; expected one of {', '.join(_KINDS)}"
    try:
        parsed = json.loads(options) if options.strip() else {}
    except json.JSONDecodeError as exc:
        return f"grammar options are not JSON: {exc}"
    if not isinstance(parsed, dict):
        return "grammar options must be a JSON object"
    held = _holdings_of(run)
    if (full := held.grammars_full()) is not None:  # before a compile: it may take seconds
        return full
    try:
        # Waits in slices: cancellation and the wall clock stop the run during a long compile.
        grammar = run.services.grammars().compile(
            _KINDS[kind], text, parsed, may_wait=run.check_can_continue, owner=run.group or f"run {run.run_id}"
        )
    except HostError as exc:  # grammar errors are HostErrors
        return error_text(exc)
    problem = held.take_grammar(grammar)
    if problem is not None:
        return problem
    return ResourceHost.own(run.resources.add(ResourceKind.GRAMMAR, grammar), int(ResourceKind.GRAMMAR))


@host_function
def unsupported(run: RunState, handle: ResourceAny) -> list[str]:
    return list(_grammar(run, handle).unsupported)


@host_function
def new_matcher(run: RunState, grammar: ResourceAny) -> ResourceHost:
    compiled = _grammar(run, grammar)
    held = _holdings_of(run)
    held.check_matcher_room(run)
    matcher = compiled.matcher(held.history)
    held.num_matchers += 1
    return ResourceHost.own(run.resources.add(ResourceKind.MATCHER, matcher), int(ResourceKind.MATCHER))


@host_function
def matcher_id(run: RunState, handle: ResourceAny) -> int:
    rep = borrowed_rep(run, handle)
    matcher_by_rep(run, rep)  # a live matcher, or a trap
    return rep


@host_function
def accept(run: RunState, handle: ResourceAny, token: int) -> bool:
    from host.grammar import GrammarLimitExceeded

    try:
        return _matcher(run, handle).accept(token)
    except GrammarLimitExceeded as exc:
        raise _limit_stop(run, exc) from None
    except HostError:
        return False  # a token id outside the vocabulary is simply not accepted


@host_function
def rollback(run: RunState, handle: ResourceAny, n: int) -> str | None:
    try:
        _matcher(run, handle).rollback(n)
    except HostError as exc:
        return error_text(exc)
    return None


@host_function
def is_terminated(run: RunState, handle: ResourceAny) -> bool:
    return _matcher(run, handle).is_terminated()


@host_function
def reset(run: RunState, handle: ResourceAny) -> None:
    _matcher(run, handle).reset()


@host_function
def fork(run: RunState, handle: ResourceAny) -> ResourceHost:
    from host.grammar import GrammarLimitExceeded

    original = _matcher(run, handle)
    held = _holdings_of(run)
    held.check_matcher_room(run)
    try:
        copy = original.fork()
    except GrammarLimitExceeded as exc:  # the run's history budget: fork has no error result
        raise _limit_stop(run, exc) from None
    held.num_matchers += 1
    return ResourceHost.own(run.resources.add(ResourceKind.MATCHER, copy), int(ResourceKind.MATCHER))


def _drop_grammar(_store: wasmtime.StoreContext, rep: int) -> None:
    run = current_or_none()
    if run is not None and (grammar := run.resources.remove(ResourceKind.GRAMMAR, rep)) is not None:
        _holdings_of(run).drop_grammar(cast("Grammar", grammar))


def _drop_matcher(_store: wasmtime.StoreContext, rep: int) -> None:
    run = current_or_none()
    if run is not None and (matcher := run.resources.remove(ResourceKind.MATCHER, rep)) is not None:
        cast("Matcher", matcher).release()
        _holdings_of(run).num_matchers -= 1


def register(instance: LinkerInstance) -> None:
    instance.add_resource("grammar", ResourceType.host(int(ResourceKind.GRAMMAR)), _drop_grammar)
    instance.add_resource("matcher", ResourceType.host(int(ResourceKind.MATCHER)), _drop_matcher)
    instance.add_func("[static]grammar.compile", compile_grammar)
    instance.add_func("[method]grammar.unsupported", unsupported)
    instance.add_func("[constructor]matcher", new_matcher)
    instance.add_func("[method]matcher.id", matcher_id)
    instance.add_func("[method]matcher.accept", accept)
    instance.add_func("[method]matcher.rollback", rollback)
    instance.add_func("[method]matcher.is-terminated", is_terminated)
    instance.add_func("[method]matcher.reset", reset)
    instance.add_func("[method]matcher.fork", fork)
