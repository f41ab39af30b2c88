"""The pass planning in C++ (`pass_plan.cpp`) against the numpy code beside it in batch_plan.py:
the same arrays (values, shapes, dtypes) for passes of every shape, the same families' keys and
masks, and the same rejection (message and field, the first failing check in the same order) for
bad requests. Arrays that do not fit together are left to the numpy code."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
import torch

from bridge_schema.batch import OutputSpec, RequestSpec
from bridge_schema.messages import Forward
from drivers.errors import RequestRejected
from drivers.torch import batch_plan
from drivers.torch.batch_plan import CacheLimits, PassPlan, build_plan, family_keys
from drivers.torch.kernels import cpu_kernels
from tests.drivers.torch.helpers import brle, forward, request

LIMITS = CacheLimits(page_size=4, num_pages=64, vocab_size=100, max_context=256, max_probe_k=8)


@pytest.fixture(scope="module")
def native() -> ModuleType:
    if not cpu_kernels.load(show_progress=False):
        pytest.skip("the C++ CPU kernels are not built here (a compiler and ninja are needed)")
    module = cpu_kernels.pass_planner()
    assert module is not None
    return module


def _random_pass(seed: int, page_size: int, masked: bool = False) -> Forward:
    """1-6 requests: prefill chunks, decode steps and empty requests on shuffled pages, with one,
    several or no output rows, some with probes and mask rows."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(64).tolist()
    specs, used = [], 0
    for c in range(int(rng.integers(1, 7))):
        start, n = int(rng.integers(0, 40)), int(rng.choice([0, 1, 1, 1, 2, 5, 9]))
        kv = start + n
        count = -(-kv // page_size)
        if used + count > len(pages):
            break
        mine = pages[used : used + count]
        used += count
        rows = sorted(rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False).tolist()) if n else []
        outputs = [OutputSpec(row, probe_k=int(rng.integers(0, 4))) for row in rows]
        mask_rows = None
        if masked and n and c % 2:
            mask_rows = [brle((rng.random(kv) < 0.7).tolist()) for _ in range(n)]
        last = kv - (count - 1) * page_size if count else 0
        tokens = rng.integers(0, 100, n).tolist()
        specs.append(RequestSpec(c, tokens, list(range(start, kv)), mine, last, outputs, mask_rows=mask_rows))
    return forward(specs)


def _numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "pass_planner", lambda: None)


def _same_arrays(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w), i


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_plan_arrays_equal_numpy(native: ModuleType, page_size: int) -> None:
    limits = dataclasses.replace(LIMITS, page_size=page_size, max_context=1024)
    shapes = set()
    for seed in range(60):
        fwd = _random_pass(seed, page_size)
        got = batch_plan._plan_arrays(fwd, limits)
        _same_arrays(got, batch_plan._plan_arrays_numpy(fwd, limits))
        shapes.add((len(fwd.last_page_len), got[6].shape[1]))
    assert len(shapes) > 10  # requests and widest request both vary


def _plan(fwd: Forward, limits: CacheLimits = LIMITS) -> PassPlan:
    return build_plan(fwd, limits, torch.device("cpu"))


@pytest.mark.parametrize(("window", "sinks"), [(0, 0), (5, 0), (5, 2), (3, 4), (1, 0)])
@pytest.mark.parametrize("masked", [False, True])
def test_families_equal_numpy(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch, window: int, sinks: int, masked: bool
) -> None:
    for seed in range(20):
        fwd = _random_pass(seed, 4, masked)
        got_plan = _plan(fwd)
        got = family_keys(got_plan, window, sinks, 4)
        with monkeypatch.context() as m:
            _numpy_only(m)
            want_plan = _plan(fwd)
            want = family_keys(want_plan, window, sinks, 4)
        for field in dataclasses.fields(PassPlan):
            a, b = getattr(got_plan, field.name), getattr(want_plan, field.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), field.name
            elif isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), field.name
        for name in ("key_index", "key_slot", "mask", "empty", "safe_mask"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


def _corrupt(name: str, value: list[int], *more: tuple[str, list[int]]) -> Callable[[Forward], Forward]:
    def apply(f: Forward) -> Forward:
        for field, v in ((name, value), *more):
            setattr(f, field, np.array(v, dtype=getattr(f, field).dtype))
        return f

    return apply


# Each corrupts a pass of two requests (3 tokens at 0 on pages [0], 1 token at 5 on pages [1, 2]);
# the ones with two faults are refused for the one `_check` looks at first.
BAD = {
    "token": _corrupt("tokens", [1, 2, 100, 3]),
    "position": _corrupt("positions", [0, 1, 256, 5]),
    "page": _corrupt("pages", [0, 1, 64]),
    "no pages": _corrupt("page_indptr", [0, 0, 3]),
    "last page empty": _corrupt("last_page_len", [3, 0]),
    "last page over": _corrupt("last_page_len", [5, 2]),
    "more tokens than slots": _corrupt("last_page_len", [2, 2]),
    "past max_context": _corrupt("pages", [0, *[1] * 65], ("page_indptr", [0, 1, 66])),
    "output row": _corrupt("out_rows", [2, 1]),
    "probe_k": _corrupt("probe_k", [0, 9]),
    "token and page": _corrupt("tokens", [1, 2, 100, 3], ("pages", [0, 1, 64])),
    "page and output row": _corrupt("pages", [0, 1, 64], ("out_rows", [3, 0])),
    "slots and probe_k": _corrupt("last_page_len", [1, 2], ("probe_k", [9, 9])),
}


def _two_requests() -> Forward:
    return forward(
        [
            request([4, 5, 6], 0, [0], 4, outputs=[OutputSpec(2, probe_k=1)]),
            request([7], 5, [1, 2], 4, outputs=[OutputSpec(0, probe_k=1)]),
        ]
    )


@pytest.mark.parametrize("case", sorted(BAD))
def test_rejections_equal_numpy(native: ModuleType, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    limits = dataclasses.replace(LIMITS, num_pages=64, max_context=256)
    _plan(_two_requests(), limits)  # the pass itself is fine
    with pytest.raises(RequestRejected) as got:
        _plan(BAD[case](_two_requests()), limits)
    with monkeypatch.context() as m:
        _numpy_only(m)
        with pytest.raises(RequestRejected) as want:
            _plan(BAD[case](_two_requests()), limits)
    assert (str(got.value), got.value.field) == (str(want.value), want.value.field)


def test_read_only_arrays(native: ModuleType) -> None:
    """Arrays decoded from a bridge frame are read-only views: read in place, no warning."""
    fwd = _random_pass(3, 4)
    want = batch_plan._plan_arrays_numpy(fwd, LIMITS)
    for field in dataclasses.fields(Forward):
        value = getattr(fwd, field.name)
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
    _same_arrays(batch_plan._plan_arrays(fwd, LIMITS), want)


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt("token_indptr", [0, 3, 5]),  # ends past the tokens
        _corrupt("token_indptr", [0, 4, 3]),  # decreases
        _corrupt("page_indptr", [1, 1, 3]),  # does not start at 0
        _corrupt("out_indptr", [0, 1]),  # one entry short
        _corrupt("last_page_len", [3]),  # one request short
        _corrupt("positions", [0, 1, 2]),  # fewer positions than tokens
    ],
)
def test_arrays_that_do_not_fit_are_left_to_numpy(native: ModuleType, corrupt: Callable[[Forward], Forward]) -> None:
    """The C++ code reads nothing it has not bounded: it returns None, and the numpy code decides
    (the bridge's checks refuse such a Forward before a driver sees it)."""
    f = corrupt(_two_requests())
    limits = LIMITS
    args = (f.token_indptr, f.tokens, f.positions, f.page_indptr, f.pages, f.last_page_len, f.out_indptr)
    out = native.plan_arrays(*args, f.out_rows, f.probe_k, limits.page_size, limits.num_pages, 100, 256, 8)
    assert out is None
