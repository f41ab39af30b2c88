"""`wafer:inferlet/adapter`: the `adapter` resource, a handle on a loaded LoRA adapter."""

from __future__ import annotations

from dataclasses import dataclass

import wasmtime
from wasmtime.component import LinkerInstance, ResourceAny, ResourceHost, ResourceType

from host.api.host_call import borrowed_rep, error_text, host_function
from host.errors import HostError
from host.sandbox.resources import ResourceKind
from host.sandbox.run_state import RunState, current_or_none

INTERFACE = "adapter"
KIND = ResourceKind.ADAPTER


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    name: str
    adapter_id: int


def loaded(run: RunState, handle: ResourceAny) -> LoadedAdapter:
    return loaded_by_rep(run, borrowed_rep(run, handle))


def loaded_by_rep(run: RunState, rep: int) -> LoadedAdapter:
    value = run.resources.get(KIND, rep)
    assert isinstance(value, LoadedAdapter)
    return value


@host_function
def load(run: RunState, name: str) -> ResourceHost | str:
    if not name:
        return "adapter name must not be empty"
    try:
        adapter_id = run.services.load_adapter(run.run_id, name)
    except HostError as exc:  # unknown adapter etc.
        return error_text(exc)
    return ResourceHost.own(run.resources.add(KIND, LoadedAdapter(name, adapter_id)), int(KIND))


@host_function
def name(run: RunState, handle: ResourceAny) -> str:
    return loaded(run, handle).name


@host_function
def handle_id(run: RunState, handle: ResourceAny) -> int:
    rep = borrowed_rep(run, handle)
    run.resources.get(KIND, rep)  # a live adapter, or a trap
    return rep


def _drop(_store: wasmtime.StoreContext, rep: int) -> None:
    # The engine keeps adapters loaded for the run; `end_run` unbinds them. Only forget the handle.
    run = current_or_none()
    if run is not None:
        run.resources.remove(KIND, rep)


def register(instance: LinkerInstance) -> None:
    instance.add_resource("adapter", ResourceType.host(int(KIND)), _drop)
    instance.add_func("[static]adapter.load", load)
    instance.add_func("[method]adapter.name", name)
    instance.add_func("[method]adapter.id", handle_id)
