"""`DirectGraphs`: a function compiled with torch.compile (Inductor) whose compiled graphs are
called directly once they exist: dynamo's own guards are checked, then the graph runs on the
inputs dynamo would have read, without dynamo's per-call frame machinery. Knows nothing of models.

Why: for the decode stack (~500 tensor inputs) a call through dynamo cost ~1.1 ms more than its
guard check (173 us) plus reading the inputs (70 us); the step is ~12 ms. Semantics stay dynamo's:
a call whose guards pass no graph goes through dynamo, which compiles (or fails, under
`fail_on_recompile`) as before; anything this module cannot map keeps the plain dynamo path.

Frozen arguments (`frozen=`): arguments that are the same objects at every call, whose attributes
and tensors' sizes are never changed once compiled (a model's config and modules; a KV cache's
pages, whose contents the graphs read and write at each call). Dynamo's guards over
them are dropped (for SmolLM2's decode stack ~3,400 of its ~3,800 checks: every weight's
metadata, every module's dict), their tensors are read once instead of at every call, and each
call checks only that the same objects came (by identity); another object raises. Measured on
that stack in a decode loop: the guard check ~280 -> ~90 us a step, reading the inputs ~165 ->
~25 us (with the layers' keys passed once per attention family, `compiled.py`).

Frozen globals (`frozen_globals=True`): dynamo's guards over the module globals the traced code
reads (its functions, modules, classes, the ops it calls: identity checks) are dropped as well, as
`torch.compiler.skip_guard_on_globals_unsafe` does; for code whose globals are never rebound while
it runs, as in a driver. A global rebound later is not seen by the graphs already compiled. The
decode stack's guard check: 61-71 -> 37-41 us a step (a decode loop, SmolLM2, AMD EPYC Zen 5)."""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor.compile_fx import compile_fx
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch._inductor.custom_graph_pass import CustomGraphPass

log = logging.getLogger(__name__)
# Inductor re-checks each input's sizes and strides in its Python wrapper (~600 checks for the
# decode stack, ~0.3 ms a call); the guards just checked them. Its C++ wrapper (`cpp_wrapper`)
# runs the graph's kernel calls without a Python step between them: SmolLM2's w8a8 batch-1 decode
# step went from ~15 to ~11 ms (AMD EPYC, AVX2, 2 threads), at a longer cold compile (~230 s).
# Inductor splits a generated CPU kernel over the threads (an OpenMP region: a fork and a join)
# once each thread gets `cpp.min_chunk_size` elements (512 by default): a batch-1 decode step's
# SiLU (1,536 elements) paid that every layer for a fraction of a microsecond of work. At 1,024 it
# runs on the calling thread; prefill's and batch 8's kernels are still split. SmolLM2's w8a8 batch-1
# decode step, both settings alternated in one process (AMD EPYC Zen 4, 2 threads): 0.977 of the
# time (AVX2 cap, 16 rounds), 0.983 (AVX-512, 12 rounds); the same tokens.
INDUCTOR_OPTIONS = {"size_asserts": False, "cpp_wrapper": True, "cpp.min_chunk_size": 1024}
# Guards built with this skip the guards of an nn.Module subtree whose dicts are unchanged (dynamo
# checks their version tags): the decode stack's guard check took 613 us a step without, 323 with.
DYNAMO_OPTIONS = {"use_recursive_dict_tags_for_guards": True}

_Inputs = Callable[[dict[str, Any]], list[Any]]
# A compiled graph's inputs: (reads the frozen ones from a frame, reads all from a frame and them).
_Reader = tuple[Callable[[dict[str, Any]], list[Any]], Callable[[dict[str, Any], list[Any]], list[Any]]]


class FrozenArgumentChanged(RuntimeError):
    """A frozen argument of `DirectGraphs` was given another object than at its first call."""


def _flat(value: Any) -> list[Any]:
    """The objects one argument's identity check compares: a list's or tuple's items, else itself."""
    return list(value) if isinstance(value, list | tuple) else [value]


class _CacheKey(CustomGraphPass):
    """A graph pass that changes nothing and adds `key` and the vector ISA Inductor generates C++
    for to its cache key (Inductor hashes a custom pass's `uuid`). Its on-disk cache sees neither:
    - what an opaque custom op's fake implementation returns: a graph compiled against an older C++
      op would be loaded as is;
    - the vector ISA (torch 2.13): a graph whose C++ was written for AVX2 (`ATEN_CPU_CAPABILITY=avx2`,
      or a cache made on an AVX2-only CPU) was loaded on an AVX-512 one and its source compiled
      there with AVX-512's 16-float vectors, for loops written to step by 8: each loop's last store
      wrote past its buffer (glibc: "corrupted size vs. prev_size")."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        return None

    def uuid(self) -> str:
        # Read at each compile, as Inductor's code generation reads it (the environment included).
        return f"{self.key}|vec_isa={pick_vec_isa()}"


_copies: dict[str, int] = {}  # copies made so far in this process, by function


def _own_copy(fn: Callable[..., Any]) -> types.FunctionType:
    """`fn` with its own code object. Dynamo keeps graphs per code object and counts them against
    its recompile limit (8) there: without copies, a process compiling models of three dtypes or
    weight kinds (three graphs each; the bench does) fails on the third. Each copy has its own name
    too (`fn#1`, `fn#2`, ... in the order made): dynamo keeps sizes it saw change ("automatic
    dynamic") per file, line and name, so a second model with a cache of another size got its
    frozen K/V pages compiled as dynamic sizes, with guards over them at every call."""
    assert isinstance(fn, types.FunctionType)
    n = _copies[fn.__qualname__] = _copies.get(fn.__qualname__, 0) + 1
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}#{n}")
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class DirectGraphs:
    """`cache_key`: what Inductor's on-disk cache cannot see but the compiled graphs depend on
    (e.g. the sources of the custom ops they call); graphs compiled under another key, or for
    another vector ISA, are not reused. `before_dynamo(*args)`: called before a call goes through
    dynamo (which may compile), e.g. to mark sizes dynamic; direct calls skip it. `frozen` and
    `frozen_globals`: see the module's docstring."""

    def __init__(
        self,
        fn: Callable[..., Any],
        cache_key: str = "",
        frozen: tuple[str, ...] = (),
        before_dynamo: Callable[..., None] | None = None,
        frozen_globals: bool = False,
    ) -> None:
        self._fn = _own_copy(fn)
        self._inductor_options: dict[str, Any] = dict(INDUCTOR_OPTIONS)
        self._inductor_options["post_grad_custom_post_pass"] = _CacheKey(cache_key)
        self._names = list(inspect.signature(fn).parameters)
        unknown = set(frozen) - set(self._names)
        assert not unknown, f"frozen names no argument of {fn.__name__}: {sorted(unknown)}"
        self._frozen = frozen
        self._before_dynamo = before_dynamo
        # How dynamo names what a frozen argument reads: `L['blocks'][0]...` in a graph's inputs,
        # `blocks[0]...` in its guards.
        self._roots = tuple(f"L[{name!r}]" for name in frozen) + frozen
        self._frozen_objects: list[list[Any]] | None = None  # `_flat` of each, from the first call
        self._frozen_globals = frozen_globals
        options = {"guard_filter_fn": self._keep_guards} if frozen or frozen_globals else None
        self._dynamo: Callable[..., Any] = torch.compile(
            self._fn, fullgraph=True, backend=self._backend, options=options
        )
        # The graph dynamo compiled in the last call, with how to read its inputs (None if they
        # cannot be read from the arguments alone, or its output is not one tensor).
        self._new: list[tuple[Callable[..., Any], _Reader | None]] = []
        self._seen: list[types.CodeType] = []  # the code of each of dynamo's cache entries seen
        self._callers: list[tuple[Callable[[dict[str, Any]], bool], Callable[..., Any], _Inputs]] = []
        self.num_direct_calls = 0

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = compile_fx(gm, example_inputs, config_patches=self._inductor_options)
        names = [node._dynamo_source.name for node in gm.graph.find_nodes(op="placeholder")]
        (outputs,) = gm.graph.find_nodes(op="output")[0].args
        readable = all(name.startswith("L[") for name in names) and len(outputs) == 1
        # Dynamo's source names are Python expressions over the frame's locals `L`; the frozen
        # ones are read once into `S` (positions in the graph's input order kept).
        frozen = [name for name in names if self._is_frozen(name)]
        items = [f"S[{frozen.index(name)}]" if self._is_frozen(name) else name for name in names]
        reader: _Reader | None = None
        if readable:
            reader = (eval(f"lambda L: [{', '.join(frozen)}]", {}), eval(f"lambda L, S: [{', '.join(items)}]", {}))
        self._new.append((compiled, reader))
        return compiled

    def _is_frozen(self, source: str) -> bool:
        """Whether `source` (an input's or a guard's source name) reads a frozen argument."""
        return any(source == root or source.startswith((root + "[", root + ".")) for root in self._roots)

    def _keep_guards(self, entries: list[Any]) -> list[bool]:
        """Dynamo's `guard_filter_fn`: drop the guards over frozen arguments (and globals)."""
        return [not self._is_frozen(e.name) and not (self._frozen_globals and e.is_global) for e in entries]

    def _check_frozen(self, frame: dict[str, Any]) -> None:
        objects = [_flat(frame[name]) for name in self._frozen]
        if self._frozen_objects is None:
            self._frozen_objects = objects
            return
        for name, now, first in zip(self._frozen, objects, self._frozen_objects, strict=True):
            if len(now) != len(first) or any(a is not b for a, b in zip(now, first, strict=True)):
                raise FrozenArgumentChanged(
                    f"{self._fn.__name__}: argument {name!r} is frozen (compiled once, its guards dropped) but "
                    "this call gave another object; a changed model needs its own DirectGraphs"
                )

    def _pair_new_graph(self, frame: dict[str, Any]) -> None:
        """Pair the graph compiled in the last call with dynamo's one new cache entry (its guards),
        by the entry's identity, never by position; a graph not paired stays behind dynamo."""
        new, self._new = self._new, []
        try:
            entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(self._fn.__code__)
            unseen = [e for e in entries if not any(e.code is code for code in self._seen)]
        except (AttributeError, RuntimeError) as exc:
            log.info("dynamo's cache entries are not readable (%s): compiled calls go through dynamo", exc)
            return
        self._seen += [e.code for e in unseen]
        if len(new) == 1 and len(unseen) == 1 and new[0][1] is not None:
            graph, (read_frozen, read) = new[0]
            frozen = read_frozen(frame)  # this frame's frozen arguments are the compiling call's
            self._callers.insert(0, (unseen[0].guard_manager.check, graph, lambda frame: read(frame, frozen)))

    def __call__(self, *args: Any) -> Any:
        frame = dict(zip(self._names, args, strict=True))
        if self._frozen:
            self._check_frozen(frame)
        if self._new:
            self._pair_new_graph(frame)
        for i, caller in enumerate(self._callers):
            check, graph, inputs = caller
            if check(frame):
                if i:  # the graph that served last is checked first next time: a guard that
                    # fails costs about as much as one that passes (~0.1 ms for the decode stack)
                    self._callers.insert(0, self._callers.pop(i))
                self.num_direct_calls += 1
                return graph(*inputs(frame))[0]
        if self._before_dynamo is not None:
            self._before_dynamo(*args)
        with torch._dynamo.config.patch(DYNAMO_OPTIONS):
            return self._dynamo(*args)
