"""`wafer:inferlet/context`: the `context` resource, a handle on an engine context id."""

from __future__ import annotations

import logging

import wasmtime
from wasmtime.component import LinkerInstance, ResourceAny, ResourceHost, ResourceType

from host.api.host_call import borrowed_rep, error_text, handle_id, host_function
from host.errors import HostError
from host.sandbox import raw_calls
from host.sandbox.resources import ResourceKind
from host.sandbox.run_state import RunState, current_or_none

INTERFACE = "context"
KIND = ResourceKind.CONTEXT

_log = logging.getLogger("wafer.sandbox")


def context_id(run: RunState, handle: ResourceAny) -> int:
    """The engine's id for a borrowed context handle."""
    value = run.resources.get(KIND, borrowed_rep(run, handle))
    assert isinstance(value, int)
    return value


def _own(run: RunState, ctx_id: int) -> ResourceHost:
    return ResourceHost.own(run.resources.add(KIND, ctx_id), int(KIND))


@host_function
def create(run: RunState) -> ResourceHost | str:
    try:
        ctx_id = run.services.create_context(run.run_id)
    except HostError as exc:  # expected (out of pages...): the guest decides what to do
        return error_text(exc)
    return _own(run, ctx_id)


@host_function
def fork(run: RunState, handle: ResourceAny) -> ResourceHost | str:
    try:
        ctx_id = run.services.fork_context(run.run_id, context_id(run, handle))
    except HostError as exc:
        return error_text(exc)
    return _own(run, ctx_id)


@host_function
def length(run: RunState, handle: ResourceAny) -> int:
    return run.services.context_length(run.run_id, context_id(run, handle))


@host_function
def truncate(run: RunState, handle: ResourceAny, new_length: int) -> str | None:
    try:
        run.services.truncate_context(run.run_id, context_id(run, handle), new_length)
    except HostError as exc:
        return error_text(exc)
    return None


@host_function
def release_pages(run: RunState, handle: ResourceAny, start: int, stop: int) -> int | str:
    try:
        return run.services.release_slots(run.run_id, context_id(run, handle), start, stop)
    except HostError as exc:
        return error_text(exc)


@host_function
def num_pages(run: RunState, handle: ResourceAny) -> int:
    return run.services.context_num_pages(run.run_id, context_id(run, handle))


@host_function
def pages_in_use(run: RunState) -> int:
    return run.services.run_usage(run.run_id)[1]


def release(run: RunState, rep: int) -> None:
    """Free one context the guest dropped (or leaked, at run end)."""
    ctx_id = run.resources.remove(KIND, rep)
    if isinstance(ctx_id, int):
        run.services.release_context(run.run_id, ctx_id)


def _drop(_store: wasmtime.StoreContext, rep: int) -> None:
    run = current_or_none()
    if run is None:  # the Store is being freed outside its run: the run's cleanup frees it
        return
    try:
        release(run, rep)
    except Exception as exc:  # a destructor must not raise into the guest
        _log.warning("[run %d] releasing context %d failed: %s", run.run_id, rep, exc)


def register(instance: LinkerInstance) -> None:
    instance.add_resource("context", ResourceType.host(int(KIND)), _drop)
    instance.add_func("[static]context.create", create)
    instance.add_func("[method]context.fork", fork)
    instance.add_func("[method]context.len", length)
    instance.add_func("[method]context.truncate", truncate)
    instance.add_func("[method]context.release-pages", release_pages)
    instance.add_func("[method]context.num-pages", num_pages)
    instance.add_func("pages-in-use", pages_in_use)
    raw_calls.add_raw_func(instance, "[method]context.id", handle_id(KIND), 1)
