"""`wafer:inferlet/grammar`: the `grammar` and `matcher` resources over `host.grammar`.

Grammars compile through the engine's compiler (one per driver, cached); matchers live here, on
the host, and `forward-pass.use-matcher` fills a row's logit mask from one when its pass runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import wasmtime
from wasmtime.component import LinkerInstance, ResourceAny, ResourceHost, ResourceType

from host.api.host_call import borrowed_rep, error_text, host_function
from host.errors import HostError
from host.sandbox.resources import ResourceKind
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
    try:
        # Waits in slices: cancellation and the wall clock stop the run during a long compile.
        grammar = run.services.grammars().compile(_KINDS[kind], text, parsed, may_wait=run.check_can_continue)
    except HostError as exc:  # grammar errors are HostErrors
        return error_text(exc)
    return ResourceHost.own(run.resources.add(ResourceKind.GRAMMAR, grammar), int(ResourceKind.GRAMMAR))


@host_function
def unsupported(run: RunState, handle: ResourceAny) -> list[str]:
    return list(_grammar(run, handle).unsupported)


@host_function
def new_matcher(run: RunState, grammar: ResourceAny) -> ResourceHost:
    matcher = _grammar(run, grammar).matcher()
    return ResourceHost.own(run.resources.add(ResourceKind.MATCHER, matcher), int(ResourceKind.MATCHER))


@host_function
def matcher_id(run: RunState, handle: ResourceAny) -> int:
    rep = borrowed_rep(run, handle)
    matcher_by_rep(run, rep)  # a live matcher, or a trap
    return rep


@host_function
def accept(run: RunState, handle: ResourceAny, token: int) -> bool:
    try:
        return _matcher(run, handle).accept(token)
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
    copy = _matcher(run, handle).fork()
    return ResourceHost.own(run.resources.add(ResourceKind.MATCHER, copy), int(ResourceKind.MATCHER))


def _drop_kind(kind: ResourceKind) -> Callable[[wasmtime.StoreContext, int], None]:
    def drop(_store: wasmtime.StoreContext, rep: int) -> None:
        run = current_or_none()
        if run is not None:
            run.resources.remove(kind, rep)

    return drop


def register(instance: LinkerInstance) -> None:
    instance.add_resource("grammar", ResourceType.host(int(ResourceKind.GRAMMAR)), _drop_kind(ResourceKind.GRAMMAR))
    instance.add_resource("matcher", ResourceType.host(int(ResourceKind.MATCHER)), _drop_kind(ResourceKind.MATCHER))
    instance.add_func("[static]grammar.compile", compile_grammar)
    instance.add_func("[method]grammar.unsupported", unsupported)
    instance.add_func("[constructor]matcher", new_matcher)
    instance.add_func("[method]matcher.id", matcher_id)
    instance.add_func("[method]matcher.accept", accept)
    instance.add_func("[method]matcher.rollback", rollback)
    instance.add_func("[method]matcher.is-terminated", is_terminated)
    instance.add_func("[method]matcher.reset", reset)
    instance.add_func("[method]matcher.fork", fork)
