"""`DirectGraphs` calls compiled graphs directly once dynamo's guards pass, with dynamo's results:
in-place writes to inputs included; a call no graph's guards accept compiles through dynamo and
is then called directly too, also after a module's attribute changed (guards built with dynamo's
recursive dict tags); where dynamo's cache entries cannot be read, calls go through dynamo. Frozen
arguments have no guards, and another object given for one raises; frozen globals have no guards."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._inductor.cpu_vec_isa import valid_vec_isa_list

from drivers.torch.runners.direct_graphs import DirectGraphs, FrozenArgumentChanged


def _write_and_sum(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    cache.index_copy_(0, slots, rows)
    return cache.sum(0) * scale


def _run(graphs: DirectGraphs, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cache = torch.zeros(6, 3, dtype=dtype)
    rows = torch.arange(6, dtype=dtype).reshape(2, 3)
    out = graphs(cache, torch.tensor([4, 1]), rows, 0.5)
    return cache, out


def _check(cache: torch.Tensor, out: torch.Tensor) -> None:
    want = torch.zeros_like(cache)
    want[[4, 1]] = torch.arange(6, dtype=cache.dtype).reshape(2, 3)
    assert torch.equal(cache, want)
    assert torch.equal(out, want.sum(0) * 0.5)


@torch.inference_mode()
def test_direct_calls_write_inputs_and_recompile_through_dynamo() -> None:
    graphs = DirectGraphs(_write_and_sum)
    _check(*_run(graphs, torch.float32))  # compiles through dynamo
    assert graphs.num_direct_calls == 0
    _check(*_run(graphs, torch.float32))
    assert graphs.num_direct_calls == 1
    _check(*_run(graphs, torch.float64))  # no graph's guards accept float64: dynamo compiles one
    assert graphs.num_direct_calls == 1
    for dtype in (torch.float64, torch.float32):
        _check(*_run(graphs, dtype))
    assert graphs.num_direct_calls == 3


@torch.inference_mode()
def test_unreadable_cache_entries_keep_the_dynamo_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(code: object) -> list[object]:
        raise AttributeError("no cache entries here")

    monkeypatch.setattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", unreadable)
    graphs = DirectGraphs(_write_and_sum)
    for _ in range(2):
        _check(*_run(graphs, torch.float32))
    assert graphs.num_direct_calls == 0


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3), requires_grad=False)


def _scaled(module: _Scale, x: torch.Tensor) -> torch.Tensor:
    return x * module.weight


@torch.inference_mode()
def test_a_rebound_module_attribute_fails_the_guards() -> None:
    module, x, graphs = _Scale(), torch.arange(3.0), DirectGraphs(_scaled)
    for _ in range(2):
        assert torch.equal(graphs(module, x), x)
    assert graphs.num_direct_calls == 1
    module.weight = nn.Parameter(torch.full((1,), 2.0), requires_grad=False)  # another shape
    assert torch.equal(graphs(module, x), x * 2)  # through dynamo: compiled again
    assert graphs.num_direct_calls == 1
    assert torch.equal(graphs(module, x), x * 2)
    assert graphs.num_direct_calls == 2


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_graphs_compiled_under_another_cache_key_are_not_reused() -> None:
    # Inductor's on-disk cache cannot see a custom op's fake implementation: a graph compiled
    # against an older C++ op must not be loaded for a new one, so its key goes into the cache's.
    key = f"test-{uuid.uuid4()}"  # never seen by the on-disk cache
    outcomes = []
    for k in (key, key, key + "-rebuilt"):
        before = _cache_counts()
        assert torch.equal(DirectGraphs(_plus_one, k)(torch.ones(3)), torch.full((3,), 3.0))
        after = _cache_counts()
        outcomes.append("hit" if after[0] > before[0] else "miss" if after[1] > before[1] else "none")
    assert outcomes == ["miss", "hit", "miss"]


def test_graphs_compiled_for_another_vector_isa_are_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's on-disk cache (torch 2.13) does not key on the vector ISA it writes C++ for: a
    graph written for AVX2 was loaded on AVX-512 and compiled there with 16-float vectors, and its
    loops' last stores wrote past their buffers (a heap corruption). Here the lower ISA comes from
    `ATEN_CPU_CAPABILITY`, which Inductor reads at each compile; the lower one is loaded second, so
    that a regression fails this test (a graph for the wider vectors computes wrong values there)
    rather than corrupting the heap of the test run."""
    isas = [str(isa) for isa in valid_vec_isa_list()]
    if not isas:
        pytest.skip("Inductor has no vector ISA on this CPU")
    lower = "avx2" if any("avx512" in isa for isa in isas) else "default"
    key = f"test-{uuid.uuid4()}"
    outcomes = []
    for capability in (None, lower, None):
        if capability is None:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        before = _cache_counts()
        assert torch.equal(DirectGraphs(_plus_one, key)(torch.ones(37)), torch.full((37,), 3.0))
        after = _cache_counts()
        outcomes.append("hit" if after[0] > before[0] else "miss" if after[1] > before[1] else "none")
    assert outcomes == ["miss", "miss", "hit"]


def _cache_counts() -> tuple[int, int]:
    """Inductor's FX graph cache hits and misses so far (dynamo may replace its counters)."""
    counters = torch._dynamo.utils.counters["inductor"]
    return counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"]


@torch.inference_mode()
def test_the_graph_that_served_last_is_checked_first() -> None:
    """With two graphs (float32, float64), a run of calls of one kind checks one guard each: the
    graph that served the call before is tried first (a failing guard check costs about what a
    passing one does: two a step on the decode stack without this)."""
    graphs = DirectGraphs(_write_and_sum)
    for dtype in (torch.float32, torch.float32, torch.float64, torch.float64):
        _run(graphs, dtype)  # both graphs compiled and paired
    checks: list[int] = []

    def counting(index: int, check: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], bool]:
        def counted(frame: dict[str, Any]) -> bool:
            checks.append(index)
            return check(frame)

        return counted

    graphs._callers = [(counting(i, c), g, r) for i, (c, g, r) in enumerate(graphs._callers)]
    assert len(graphs._callers) == 2
    for dtype in (torch.float32, torch.float64):
        checks.clear()
        for _ in range(3):
            _check(*_run(graphs, dtype))
        assert len(checks) in (3, 4) and checks[-1] == checks[-2], checks  # one check a call once it served


def _scaled_sum(modules: list[_Scale], x: torch.Tensor) -> torch.Tensor:
    return sum((x * m.weight for m in modules), torch.zeros_like(x))


def _guards(graphs: DirectGraphs) -> str:
    (entry,) = torch._dynamo.eval_frame._debug_get_cache_entry_list(graphs._fn.__code__)
    return str(entry.guard_manager)


@torch.inference_mode()
def test_frozen_arguments_have_no_guards_and_their_tensors_are_read_once() -> None:
    """The decode stack's ~500 inputs cost ~280 us a step in guards and ~165 us in reading them;
    most are the model's weights, which never change once compiled (frozen)."""
    modules, x = [_Scale(), _Scale()], torch.arange(3.0)
    modules[1].weight.fill_(2.0)
    plain, frozen = DirectGraphs(_scaled_sum), DirectGraphs(_scaled_sum, frozen=("modules",))
    for graphs in (plain, frozen):
        for _ in range(2):
            assert torch.equal(graphs(modules, x), x * 3)
        assert graphs.num_direct_calls == 1
    assert "L['modules']" in _guards(plain)
    assert "L['modules']" not in _guards(frozen) and "L['x']" in _guards(frozen)
    modules[0].weight.fill_(4.0)  # in place: the same tensor, read by the graph at each call
    assert torch.equal(frozen(modules, x), x * 6)
    assert torch.equal(frozen(modules, x.double()), x.double() * 6)  # x keeps its guards: compiled again
    assert frozen.num_direct_calls == 2


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _doubled_plus_one(x: torch.Tensor) -> torch.Tensor:
    return _doubled(x) + 1


@torch.inference_mode()
def test_frozen_globals_have_no_guards() -> None:
    """The decode stack's guard check 61-71 -> 37-41 us a step: much of it were the identities of
    the functions, modules and ops its code reads from its globals, which a driver never rebinds."""
    x = torch.arange(3.0)
    plain, frozen = DirectGraphs(_doubled_plus_one), DirectGraphs(_doubled_plus_one, frozen_globals=True)
    for graphs in (plain, frozen):
        for _ in range(2):
            assert torch.equal(graphs(x), x * 2 + 1)
        assert graphs.num_direct_calls == 1
    assert "G['_doubled']" in _guards(plain)
    assert "G[" not in _guards(frozen) and "L['x']" in _guards(frozen)
    assert torch.equal(frozen(x.double()), x.double() * 2 + 1)  # x keeps its guards: compiled again
    assert frozen.num_direct_calls == 1


@torch.inference_mode()
def test_another_object_for_a_frozen_argument_raises() -> None:
    modules, x = [_Scale(), _Scale()], torch.arange(3.0)
    graphs = DirectGraphs(_scaled_sum, frozen=("modules",))
    graphs(modules, x)
    graphs(list(modules), x)  # another list of the same modules
    for changed in ([modules[0], _Scale()], modules[:1], [*modules, modules[0]]):
        with pytest.raises(FrozenArgumentChanged, match="'modules' is frozen"):
            graphs(changed, x)
    assert torch.equal(graphs(modules, x), x * 2)


@torch.inference_mode()
def test_before_dynamo_runs_only_on_calls_that_go_through_dynamo() -> None:
    """The decode stack marks its sizes dynamic there, not at every direct call (~40 us a step)."""
    seen: list[torch.dtype] = []
    graphs = DirectGraphs(_write_and_sum, before_dynamo=lambda cache, *rest: seen.append(cache.dtype))
    for dtype in (torch.float32, torch.float32, torch.float64, torch.float32, torch.float64):
        _check(*_run(graphs, dtype))
    assert seen == [torch.float32, torch.float64] and graphs.num_direct_calls == 3
