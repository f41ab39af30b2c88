"""Multi-step requests on the torch driver (run by `drivers.multistep`, as `drivers.serve` does):
N steps in one request sample exactly what N single decode steps sample, alone and batched with
an ordinary prefill, on full attention and on a sliding-window model, across page boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward
from drivers.multistep import run_steps
from drivers.torch.driver import TorchDriver
from tests.drivers.torch.helpers import (
    load_dir,
    make_driver,
    random_tokens,
    request,
    write_tiny_gemma,
    write_tiny_llama,
)

PAGE = 4
STEPS = 11
SAMPLERS = [Sampler(), Sampler.random(0.8, top_k=20, seed=9)]


@pytest.fixture(scope="module", params=["llama", "gemma_window_4"])
def checkpoint_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return write_tiny_llama(path)
    return write_tiny_gemma(path, sliding_window=4)


def _prefill(drv: TorchDriver, prompt: list[int], pages: list[int], sampler: Sampler, ctx: int) -> int:
    out = drv.forward(build_forward(1, [request(prompt, 0, pages, PAGE, sampler=sampler, context_id=ctx)]))
    return int(out.tokens[0])


def _multi_step(token: int, start: int, pages: list[int], sampler: Sampler, ctx: int) -> RequestSpec:
    kv_len = start + STEPS
    n = (kv_len + PAGE - 1) // PAGE
    return RequestSpec(
        context_id=ctx,
        tokens=[token],
        positions=[start],
        pages=pages[:n],
        last_page_len=kv_len - (n - 1) * PAGE,
        outputs=[OutputSpec(j, sampler) for j in range(STEPS)],
        steps=STEPS,
    )


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["greedy", "seeded"])
def test_multi_step_samples_what_single_steps_sample(checkpoint_dir: Path, sampler: Sampler) -> None:
    ckpt = load_dir(checkpoint_dir)
    vocab = ckpt.cfg.vocab_size
    prompt = random_tokens(7, vocab, seed=3)
    other = random_tokens(6, vocab, seed=4)
    pages = list(range(0, 6))  # 7 + 11 slots of the multi-step context
    other_pages = list(range(8, 10))

    single = make_driver(ckpt, page_size=PAGE)
    token = _prefill(single, prompt, pages, sampler, ctx=1)
    expected = []
    for j in range(STEPS):
        out = single.forward(build_forward(1, [request([token], 7 + j, pages, PAGE, sampler=sampler, context_id=1)]))
        token = int(out.tokens[0])
        expected.append(token)
    other_expected = _prefill(single, other, other_pages, Sampler(), ctx=2)

    multi = make_driver(ckpt, page_size=PAGE)
    first = _prefill(multi, prompt, pages, sampler, ctx=1)
    both = build_forward(
        2, [request(other, 0, other_pages, PAGE, context_id=2), _multi_step(first, 7, pages, sampler, ctx=1)]
    )
    result = run_steps(multi.forward, both, PAGE)
    assert result.tokens.tolist() == [other_expected, *expected]
