"""The sampler chain's logit bias and penalties on the torch driver, against the plain numpy
reference (`drivers.sampler_chain.apply_chain_np`) on a tiny random Llama's own logits: greedy
and seeded rows, alone and batched, the bias banning and forcing, and multi-step requests."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, split_result
from bridge_schema.sampling import seeded_uniform, xtc_uniform
from drivers.multistep import run_steps
from drivers.sampler_chain import Filters, SlotTokens, apply_chain_np, sample_row_np, sample_row_with_state
from drivers.torch.driver import TorchDriver
from drivers.torch.sampling import apply_chain
from tests.drivers.torch.helpers import forward, load_dir, make_driver, random_tokens, request, write_tiny_llama

V = 96
PS = 4
PROMPT = random_tokens(10, V, 3) + random_tokens(6, V, 3)[:6]  # with repeats for the penalties


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> TorchDriver:
    return make_driver(load_dir(write_tiny_llama(tmp_path_factory.mktemp("llama") / "m")), page_size=PS, num_pages=32)


def _chain(base: Sampler, **kw: object) -> Sampler:
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


PENALTIES = {
    "repetition": {"repetition_penalty": 1.8},
    "presence": {"presence_penalty": 1.5, "penalty_from": 6},
    "frequency": {"frequency_penalty": 0.9, "penalty_last_n": 8},
    "all": {"repetition_penalty": 0.7, "presence_penalty": -0.5, "frequency_penalty": 0.6, "repetition_from": 3},
}


def _reference(driver: TorchDriver, specs: list, o: int = 0) -> np.ndarray:  # type: ignore[type-arg]
    """Output row `o`'s logits after the chain, by the plain version, on the model's own logits."""
    f = forward(specs)
    raw = driver.logits(f).float().numpy()
    table = SlotTokens(32, PS)
    table.write(f)
    return apply_chain_np(raw, f, table)[o]


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_greedy_with_penalties_matches_the_reference(driver: TorchDriver, name: str) -> None:
    s = _chain(Sampler.greedy(), **PENALTIES[name])
    spec = request(PROMPT, 0, range(8), PS, sampler=s)
    expect = _reference(driver, [spec])
    f = forward([spec])
    assert split_result(f, driver.forward(f))[0][0].token == int(np.argmax(expect))


def test_a_strong_penalty_changes_the_choice(driver: TorchDriver) -> None:
    # Extend the prompt greedily until the model's choice is a token already in it.
    tokens = list(PROMPT[:8])
    for _ in range(24):
        best = int(driver.logits(forward([request(tokens, 0, range(8), PS)]))[0].argmax())
        if best in tokens:
            break
        tokens.append(best)
    assert best in tokens
    s = _chain(Sampler.greedy(), frequency_penalty=100.0)
    f = forward([request(tokens, 0, range(8), PS, sampler=s)])
    assert split_result(f, driver.forward(f))[0][0].token not in tokens


def test_seeded_with_a_chain_matches_the_reference_alone_and_batched(driver: TorchDriver) -> None:
    for seed in range(6):
        s = _chain(Sampler.random(temperature=1.3, top_k=20, seed=seed), **PENALTIES["all"])
        s = _chain(s, logit_bias=((3, 2.0), (40, -100.0)))
        spec = request(PROMPT, 0, range(8), PS, sampler=s, context_id=1)
        other = request(PROMPT[:7], 0, range(8, 16), PS, sampler=Sampler.greedy(), context_id=2)
        expect_row = _reference(driver, [spec])
        u = float(seeded_uniform([seed], [len(PROMPT) - 1])[0])
        expect = sample_row_np(expect_row, 1.3, 20, 1.0, 0.0, u)
        alone = forward([spec])
        batched = forward([other, spec])
        assert split_result(alone, driver.forward(alone))[0][0].token == expect
        assert split_result(batched, driver.forward(batched))[1][0].token == expect


def test_bias_forces_and_bans(driver: TorchDriver) -> None:
    raw = driver.logits(forward([request(PROMPT, 0, range(8), PS)]))[0]
    worst, best = int(raw.argmin()), int(raw.argmax())
    for base in (Sampler.greedy(), Sampler.random(temperature=1.0, seed=5)):
        f = forward([request(PROMPT, 0, range(8), PS, sampler=_chain(base, logit_bias=((worst, 100.0),)))])
        assert split_result(f, driver.forward(f))[0][0].token == worst
    f = forward([request(PROMPT, 0, range(8), PS, sampler=_chain(Sampler.greedy(), logit_bias=((best, -100.0),)))])
    assert split_result(f, driver.forward(f))[0][0].token != best


def test_torch_stages_equal_the_plain_version_on_random_logits() -> None:
    rng = np.random.default_rng(0)
    specs = [
        request(PROMPT, 0, range(8), PS, sampler=_chain(Sampler.greedy(), **PENALTIES["all"]), context_id=1),
        request(PROMPT[:9], 0, range(8, 16), PS, sampler=_chain(Sampler.greedy(), logit_bias=((1, 0.5), (7, -3.0)))),
        request(PROMPT[:5], 0, range(16, 24), PS),
    ]
    f = forward(specs)
    table = SlotTokens(32, PS)
    table.write(f)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    got = apply_chain(torch.from_numpy(logits), f, table).numpy()
    np.testing.assert_allclose(got, apply_chain_np(logits, f, table), rtol=1e-6)
    assert not np.array_equal(got[:2], logits[:2]) and np.array_equal(got[2], logits[2])


def test_multi_step_with_penalties_equals_single_steps(driver: TorchDriver) -> None:
    s = _chain(Sampler.greedy(), frequency_penalty=2.0, penalty_from=len(PROMPT))
    prompt = request(PROMPT, 0, range(8), PS, sampler=s)
    f = forward([prompt])
    first = split_result(f, driver.forward(f))[0][0].token
    # Four single steps on pages 0..7.
    said, tokens = [first], list(PROMPT)
    for _ in range(4):
        tokens.append(said[-1])
        step = request([said[-1]], len(tokens) - 1, range(8), PS, sampler=s)
        f = forward([step])
        said.append(split_result(f, driver.forward(f))[0][0].token)
    # The same four steps as one multi-step request over a copy of the prompt's pages.
    f = forward([request(PROMPT, 0, range(8, 16), PS, sampler=s)])
    assert split_result(f, driver.forward(f))[0][0].token == first
    kv_len = len(PROMPT) + 4  # the request's slots count all four steps
    pages = list(range(8, 8 + -(-kv_len // PS)))
    outputs = [OutputSpec(j, s) for j in range(4)]
    multi = RequestSpec(9, [first], [len(PROMPT)], pages, kv_len - (len(pages) - 1) * PS, outputs, steps=4)
    assert run_steps(driver.forward, forward([multi]), PS).tokens.tolist() == said[1:]
    assert len(set(said)) > 1  # the penalty moved the choice at least once


FILTERS = {
    "typical": {"typical_p": 0.6},
    "top_n_sigma": {"top_n_sigma": 0.8},
    "xtc": {"xtc_probability": 0.7, "xtc_threshold": 0.05},
    "all": {"typical_p": 0.8, "top_n_sigma": 1.2, "xtc_probability": 0.5, "xtc_threshold": 0.08},
}


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_filters_match_the_reference_alone_and_batched(driver: TorchDriver, name: str) -> None:
    kw = FILTERS[name]
    raw = driver.logits(forward([request(PROMPT, 0, range(8), PS)]))[0].float().numpy()
    differs = 0
    for seed in range(12):
        s = _chain(Sampler.random(temperature=1.5, top_k=30, seed=seed), **kw)
        spec = request(PROMPT, 0, range(8), PS, sampler=s, context_id=1)
        other = request(PROMPT[:7], 0, range(8, 16), PS, sampler=Sampler.random(seed=3), context_id=2)
        position = len(PROMPT) - 1
        u, xtc = float(seeded_uniform([seed], [position])[0]), float(xtc_uniform([seed], [position])[0])
        typical, sigma = kw.get("typical_p", 1.0), kw.get("top_n_sigma", 0.0)
        filters = Filters(typical, sigma, kw.get("xtc_probability", 0.0), kw.get("xtc_threshold", 0.1), xtc)
        expect = sample_row_np(raw, 1.5, 30, 1.0, 0.0, u, filters)
        differs += expect != sample_row_np(raw, 1.5, 30, 1.0, 0.0, u)
        alone, batched = forward([spec]), forward([other, spec])
        assert split_result(alone, driver.forward(alone))[0][0].token == expect
        assert split_result(batched, driver.forward(batched))[1][0].token == expect
    assert differs  # the filter changed at least one draw


def test_mirostat_steps_match_the_reference(driver: TorchDriver) -> None:
    """Decode steps one token at a time with Mirostat 2: each step's token and the mu it leaves
    (kept in the driver's slot table) equal the plain version's, on the model's own logits."""
    tau, eta = 4.0, 0.9
    s = _chain(Sampler.random(temperature=1.2, seed=8), mirostat_tau=tau, mirostat_eta=eta)
    tokens, mu, moved = list(PROMPT[:6]), 2 * tau, 0
    pages = range(16, 24)
    spec = request(tokens, 0, pages, PS, sampler=s, context_id=5)
    for _ in range(6):
        f = forward([spec])
        raw = driver.logits(f)[0].float().numpy()
        position = len(tokens) - 1
        u = float(seeded_uniform([8], [position])[0])
        filters = Filters(mirostat_tau=tau, mirostat_eta=eta, mirostat_mu=mu)
        expect, new_mu = sample_row_with_state(raw, 1.2, 0, 1.0, 0.0, u, filters)
        assert split_result(f, driver.forward(f))[0][0].token == expect
        moved += expect != sample_row_np(raw, 1.2, 0, 1.0, 0.0, u)
        slot = pages[position // PS] * PS + position % PS
        assert driver.slot_tokens.mu[slot] == pytest.approx(new_mu, rel=1e-4)
        mu = new_mu
        tokens.append(expect)
        spec = request([expect], len(tokens) - 1, pages, PS, sampler=s, context_id=5)
    assert moved  # Mirostat changed at least one draw


def test_dry_matches_the_plain_version_in_the_driver(driver: TorchDriver) -> None:
    """A prompt that repeats itself: DRY's penalty on the token that would continue the repeat,
    in the torch path and the plain one, on random logits and on the model's own."""
    loop = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    dry = _chain(Sampler.greedy(), dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    specs = [
        request(loop, 0, range(8), PS, sampler=dry, context_id=1),
        request(loop, 0, range(8, 16), PS, sampler=_chain(dry, dry_breakers=(6,)), context_id=2),
        request(loop, 0, range(16, 24), PS, context_id=3),
    ]
    f = forward(specs)
    table = SlotTokens(32, PS)
    table.write(f)
    logits = np.random.default_rng(1).standard_normal((3, V)).astype(np.float32)
    got = apply_chain(torch.from_numpy(logits), f, table).numpy()
    np.testing.assert_allclose(got, apply_chain_np(logits, f, table), rtol=1e-6)
    # "5 6" ends the prompt: "5 6 7 8 5 6" was seen, so 7 continues a repeat of 6 (exponent 4).
    assert got[0, 7] == pytest.approx(logits[0, 7] - 0.8 * 1.75**4, rel=1e-5)
    assert np.count_nonzero(got[0] != logits[0]) == 1
    assert np.array_equal(got[1], logits[1]) and np.array_equal(got[2], logits[2])  # 6 breaks it; no DRY
    forced = _chain(dry, dry_multiplier=50.0)
    spec = request(loop, 0, range(8), PS, sampler=forced)
    expect = _reference(driver, [spec])
    f = forward([spec])
    token = split_result(f, driver.forward(f))[0][0].token
    assert token == int(np.argmax(expect)) and token != 7
