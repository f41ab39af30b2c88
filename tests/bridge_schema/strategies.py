"""Hypothesis strategies for random *valid* messages of every type."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
from hypothesis import strategies as st

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward, pack_allowed
from bridge_schema.fields import Wire
from bridge_schema.messages import (
    MESSAGE_TYPES,
    Adapter,
    Copy,
    Forward,
    ForwardResult,
    Message,
    Probe,
    SamplerKind,
)
from tests.bridge_schema.samples import LIMITS

_INT_MAX = {"u8": 2**8 - 1, "u32": 2**32 - 1, "u64": 2**64 - 1, "i32": 2**31 - 1, "i64": 2**63 - 1}
_text = st.text(max_size=20)


def _scalar(wire: Wire) -> st.SearchStrategy[Any]:
    if wire.kind == "int":
        lo = 0 if wire.int_range.startswith("u") else -_INT_MAX[wire.int_range] - 1
        return st.integers(lo, _INT_MAX[wire.int_range])
    if wire.kind == "float":
        return st.floats(allow_nan=False, allow_infinity=False)
    if wire.kind == "str":
        return _text
    if wire.kind == "strs":
        return st.lists(_text, max_size=4)
    if wire.kind == "stats":
        return st.dictionaries(_text, st.one_of(st.integers(-(2**63), 2**63 - 1), _text), max_size=4)
    dtype = np.dtype(wire.dtype)
    if dtype.kind == "f":
        values = st.lists(st.floats(-1e30, 0, width=32), max_size=8)
    else:
        info = np.iinfo(dtype)
        values = st.lists(st.integers(int(info.min), int(info.max)), max_size=8)
    return values.map(lambda v: np.array(v, dtype=dtype))


def _generic(cls: type[Message]) -> st.SearchStrategy[Message]:
    kwargs = {f.name: _scalar(f.metadata["wire"]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return st.builds(cls, **kwargs)


@st.composite
def sampler(draw: st.DrawFn) -> Sampler:
    if draw(st.booleans()):
        base = Sampler.greedy()
    else:
        base = Sampler.random(
            temperature=draw(st.floats(0.0625, 2.0, width=32)),
            top_k=draw(st.integers(0, 50)),
            top_p=draw(st.floats(0.0625, 1.0, width=32)),
            min_p=draw(st.floats(0.0, 0.875, width=32)),
            seed=draw(st.integers(-1, 2**63 - 1)),
        )
    if not draw(st.integers(0, 3)):  # a chain on a quarter of the rows
        penalty = st.floats(-2.0, 2.0, width=32)
        bias = st.dictionaries(st.integers(0, 259), st.floats(-100.0, 100.0, width=32), max_size=4)
        base = dataclasses.replace(
            base,
            repetition_penalty=draw(st.floats(0.5, 2.0, width=32)),
            presence_penalty=draw(penalty),
            frequency_penalty=draw(penalty),
            penalty_from=draw(st.integers(0, 8)),
            repetition_from=draw(st.integers(0, 8)),
            penalty_last_n=draw(st.integers(0, 64)),
            logit_bias=tuple(sorted(draw(bias).items())),
            typical_p=draw(st.floats(0.0625, 1.0, width=32)),
            top_n_sigma=draw(st.floats(0.0, 4.0, width=32)),
            xtc_probability=draw(st.floats(0.0, 1.0, width=32)),
            xtc_threshold=draw(st.floats(0.0, 1.0, width=32)),
            mirostat_tau=draw(st.floats(0.0, 10.0, width=32)),
            mirostat_eta=draw(st.floats(0.0, 1.0, width=32)),
            dry_multiplier=draw(st.floats(0.0, 2.0, width=32)),
            dry_base=draw(st.floats(1.0, 3.0, width=32)),
            dry_allowed_length=draw(st.integers(0, 8)),
            dry_last_n=draw(st.integers(0, 64)),
            dry_breakers=tuple(draw(st.lists(st.integers(0, 259), max_size=3))),
        )
    return base


@st.composite
def brle_row(draw: st.DrawFn, total: int) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=4)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


@st.composite
def request_spec(draw: st.DrawFn, context_id: int) -> RequestSpec:
    page_size = LIMITS.page_size
    if draw(st.integers(0, 4)) == 0:  # a multi-step request: one token, one output per step
        steps = draw(st.integers(2, 6))
        kv_len = steps + draw(st.integers(0, 12))
        n_pages = (kv_len + page_size - 1) // page_size
        return RequestSpec(
            context_id=context_id,
            tokens=[draw(st.integers(0, LIMITS.vocab_size - 1))],
            positions=[draw(st.integers(0, LIMITS.max_context - steps))],
            pages=draw(st.lists(st.integers(0, LIMITS.num_pages - 1), min_size=n_pages, max_size=n_pages)),
            last_page_len=kv_len - (n_pages - 1) * page_size,
            outputs=[OutputSpec(j, draw(sampler())) for j in range(steps)],
            adapter_id=draw(st.integers(-1, 5)),
            steps=steps,
        )
    n_tokens = draw(st.integers(1, 8))
    kv_len = n_tokens + draw(st.integers(0, 12))
    n_pages = (kv_len + page_size - 1) // page_size
    pages = draw(st.lists(st.integers(0, LIMITS.num_pages - 1), min_size=n_pages, max_size=n_pages))
    rows = sorted(draw(st.sets(st.integers(0, n_tokens - 1), max_size=n_tokens)))
    outputs = []
    for row in rows:
        probe = draw(st.sampled_from(list(Probe)))
        mask = None
        if draw(st.booleans()):
            allowed = draw(st.lists(st.integers(0, LIMITS.vocab_size - 1), min_size=1, max_size=20))
            mask = pack_allowed(LIMITS.vocab_size, allowed)
        outputs.append(OutputSpec(row, draw(sampler()), probe, draw(st.integers(0, LIMITS.max_probe_k)), mask))
    masked = draw(st.booleans())
    return RequestSpec(
        context_id=context_id,
        tokens=draw(st.lists(st.integers(0, LIMITS.vocab_size - 1), min_size=n_tokens, max_size=n_tokens)),
        positions=draw(st.lists(st.integers(0, LIMITS.max_context - 1), min_size=n_tokens, max_size=n_tokens)),
        pages=pages,
        last_page_len=kv_len - (n_pages - 1) * page_size,
        outputs=outputs,
        adapter_id=draw(st.integers(-1, 5)),
        mask_rows=[draw(brle_row(kv_len)) for _ in range(n_tokens)] if masked else None,
    )


@st.composite
def forward(draw: st.DrawFn) -> Forward:
    n = draw(st.integers(1, 5))
    return build_forward(draw(st.integers(0, 2**64 - 1)), [draw(request_spec(i)) for i in range(n)])


@st.composite
def forward_result(draw: st.DrawFn) -> ForwardResult:
    n = draw(st.integers(0, 5))
    k = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    d = draw(st.lists(st.sampled_from([0, 6]), min_size=n, max_size=n))
    logprob = st.one_of(st.floats(-50, 0, width=32), st.just(float("-inf")))
    return ForwardResult(
        id=draw(st.integers(0, 100)),
        tokens=np.array(draw(st.lists(st.integers(0, 259), min_size=n, max_size=n)), np.int32),
        logprobs=np.array(draw(st.lists(logprob, min_size=n, max_size=n)), np.float32),
        topk_indptr=np.cumsum([0, *k]).astype(np.uint32),
        topk_ids=np.array(draw(st.lists(st.integers(0, 259), min_size=sum(k), max_size=sum(k))), np.uint32),
        topk_logprobs=np.array(draw(st.lists(logprob, min_size=sum(k), max_size=sum(k))), np.float32),
        dist_indptr=np.cumsum([0, *d]).astype(np.uint32),
        dists=np.array(draw(st.lists(logprob, min_size=sum(d), max_size=sum(d))), np.float32),
    )


@st.composite
def copy(draw: st.DrawFn) -> Copy:
    pages = draw(st.lists(st.integers(0, LIMITS.num_pages - 1), unique=True, max_size=10))
    half = len(pages) // 2
    return Copy(
        id=draw(st.integers(0, 9)),
        src_pages=np.array(pages[:half], np.uint32),
        dst_pages=np.array(pages[half : 2 * half], np.uint32),
    )


_SPECIAL: dict[type[Message], st.SearchStrategy[Any]] = {
    Forward: forward(),
    ForwardResult: forward_result(),
    Copy: copy(),
    Adapter: st.builds(
        Adapter,
        id=st.integers(0, 9),
        op=st.sampled_from(["load", "unload"]),
        adapter_id=st.integers(0, 9),
        path=st.text(min_size=1, max_size=10),
    ),
}


def any_message() -> st.SearchStrategy[Message]:
    return st.one_of(*[_SPECIAL[cls] if cls in _SPECIAL else _generic(cls) for cls in MESSAGE_TYPES])


_ = SamplerKind  # re-exported for tests that build samplers by kind
