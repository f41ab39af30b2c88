"""Logit masks (bit j of word i = token 32i+j), samplers (greedy, temperature, top-k, top-p,
min-p, seeded and reproducible) and probe outputs, on a tiny random Llama; random sampling both
in the C++ op (`cpu_kernels.sample_rows`, where it builds) and on the torch path beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge_schema.batch import OutputSpec, Sampler, pack_allowed, split_result
from bridge_schema.messages import Probe
from drivers.torch.driver import TorchDriver
from drivers.torch.kernels import cpu_kernels
from drivers.torch.sampling import unpack_logit_masks
from tests.drivers.torch.helpers import forward, load_dir, make_driver, random_tokens, request, write_tiny_llama

V = 96
PAGES = list(range(8))
TOKS = random_tokens(6, V, 7)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> TorchDriver:
    return make_driver(load_dir(write_tiny_llama(tmp_path_factory.mktemp("llama") / "m")), page_size=4, num_pages=8)


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def random_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Random rows sampled by the C++ op (where the kernels are built) or by the torch path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "sample_rows", lambda *args: None)
    return str(request.param)


def _one(drv: TorchDriver, out: OutputSpec, toks: list[int] = TOKS) -> tuple[int, object]:
    f = forward([request(toks, 0, PAGES, 4, outputs=[out])])
    res = split_result(f, drv.forward(f))[0][0]
    return res.token, res


def test_bit_order_lowest_bit_first() -> None:
    words = torch.tensor([[0, 1 << 1, 0]], dtype=torch.int64)  # word 1, bit 1 -> token 33
    assert unpack_logit_masks(words, V)[0].nonzero().flatten().tolist() == [33]


def test_logit_mask_constrains_greedy_and_random(driver: TorchDriver) -> None:
    logits = driver.logits(forward([request(TOKS, 0, PAGES, 4)]))[0]
    best = int(logits.argmax())
    allowed = [t for t in (33, 5, 64, 95) if t != best]
    expect = max(allowed, key=lambda t: float(logits[t]))
    assert _one(driver, OutputSpec(row=5, logit_mask=pack_allowed(V, allowed)))[0] == expect
    for seed in range(20):
        s = Sampler.random(temperature=2.0, seed=seed)
        assert _one(driver, OutputSpec(row=5, sampler=s, logit_mask=pack_allowed(V, allowed)))[0] in allowed


def test_seeded_sampling_is_reproducible_and_varies_with_seed(driver: TorchDriver) -> None:
    draws = [_one(driver, OutputSpec(row=5, sampler=Sampler.random(temperature=5.0, seed=s)))[0] for s in range(16)]
    again = [_one(driver, OutputSpec(row=5, sampler=Sampler.random(temperature=5.0, seed=s)))[0] for s in range(16)]
    assert draws == again
    assert len(set(draws)) > 3


def test_top_k_one_and_tiny_top_p_are_greedy(driver: TorchDriver) -> None:
    greedy = _one(driver, OutputSpec(row=5))[0]
    for seed in range(8):
        assert _one(driver, OutputSpec(row=5, sampler=Sampler.random(3.0, top_k=1, seed=seed)))[0] == greedy
        assert _one(driver, OutputSpec(row=5, sampler=Sampler.random(3.0, top_p=1e-6, seed=seed)))[0] == greedy
        assert _one(driver, OutputSpec(row=5, sampler=Sampler.random(3.0, min_p=0.9999, seed=seed)))[0] == greedy


def test_top_k_limits_the_support(driver: TorchDriver) -> None:
    logits = driver.logits(forward([request(TOKS, 0, PAGES, 4)]))[0]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    for seed in range(30):
        assert _one(driver, OutputSpec(row=5, sampler=Sampler.random(50.0, top_k=3, seed=seed)))[0] in top3


def test_sampling_follows_the_distribution(driver: TorchDriver) -> None:
    logits = driver.logits(forward([request(TOKS, 0, PAGES, 4)]))[0]
    probs = torch.softmax(logits / 2.0, -1)
    f = forward([request(TOKS, 0, PAGES, 4, outputs=[OutputSpec(row=5, sampler=Sampler.random(2.0))] * 1)])
    counts = np.zeros(V)
    for _ in range(300):
        counts[int(driver.forward(f).tokens[0])] += 1
    top = int(probs.argmax())
    assert abs(counts[top] / 300 - float(probs[top])) < 0.12


def test_probes_are_log_softmax_of_masked_raw_logits(driver: TorchDriver) -> None:
    logits = driver.logits(forward([request(TOKS, 0, PAGES, 4)]))[0]
    allowed = list(range(0, V, 2))
    out = OutputSpec(
        row=5,
        sampler=Sampler.random(temperature=0.5, seed=1),  # temperature must not affect probes
        probe=Probe.LOGPROBS | Probe.DISTRIBUTION,
        probe_k=5,
        logit_mask=pack_allowed(V, allowed),
    )
    token, res = _one(driver, out)
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]
    expect = torch.log_softmax(masked, -1)
    assert token in allowed
    assert res.logprob == pytest.approx(float(expect[token]), abs=1e-5)  # type: ignore[attr-defined]
    assert res.topk_ids.tolist() == torch.topk(expect, 5).indices.tolist()  # type: ignore[attr-defined]
    np.testing.assert_allclose(res.topk_logprobs, torch.topk(expect, 5).values.numpy(), atol=1e-5)  # type: ignore[attr-defined]
    dist = res.distribution  # type: ignore[attr-defined]
    assert dist.shape == (V,) and np.isneginf(dist[1::2]).all()
    np.testing.assert_allclose(dist[::2], expect[::2].numpy(), atol=1e-5)


def test_a_scored_row_reports_the_given_tokens_logprob(driver: TorchDriver) -> None:
    """score_token: the logprob of a given continuation (each next prompt token, for echo), not
    the sampled token's; the row still samples, and its top-k is the usual one."""
    rows = driver.logits(forward([request(TOKS, 0, PAGES, 4, outputs=[OutputSpec(r) for r in range(5)])]))
    outs = [OutputSpec(row=r, probe=Probe.LOGPROBS, probe_k=3, score_token=TOKS[r + 1]) for r in range(5)]
    f = forward([request(TOKS, 0, PAGES, 4, outputs=outs)])
    assert f.score_tokens.tolist() == TOKS[1:6]
    results = split_result(f, driver.forward(f))[0]
    for r, res in enumerate(results):
        expect = torch.log_softmax(rows[r], -1)
        assert res.logprob == pytest.approx(float(expect[TOKS[r + 1]]), abs=1e-5)
        assert res.token == int(rows[r].argmax())  # greedy: the model's own choice
        assert res.topk_ids.tolist() == torch.topk(expect, 3).indices.tolist()  # type: ignore[attr-defined]
