"""LoRA adapters: load one by name, then give it to a context so its passes run through it."""

from __future__ import annotations

from componentize_py_types import Err
from wit_world.imports import adapter as _adapter

from inferlet.errors import InferletError


class AdapterError(InferletError):
    """The host could not load the adapter (unknown name, driver refused it)."""


class Adapter:
    """A loaded adapter. Loading the same name twice is cheap: the host keeps adapters loaded."""

    def __init__(self, handle: _adapter.Adapter) -> None:
        self._handle = handle
        self._id = handle.id()

    @staticmethod
    def load(name: str) -> Adapter:
        try:
            return Adapter(_adapter.Adapter.load(name))
        except Err as e:
            raise AdapterError(str(e.value)) from None

    @property
    def name(self) -> str:
        return self._handle.name()

    @property
    def id(self) -> int:
        """What `ForwardPass.use_adapter` takes."""
        return self._id
