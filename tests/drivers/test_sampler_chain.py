"""The sampler chain's stages before the sampler (logit bias, penalties) as every driver shares
them (`drivers.sampler_chain`), and on the dummy driver: the token in each KV slot follows
writes, copies and truncation; the penalties' windows; bias that bans and forces; a scripted
distribution (`--logits`) sampled as the torch driver would; multi-step requests with a chain."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward, split_result
from bridge_schema.messages import Hello, Probe
from drivers.dummy.cli import create_driver
from drivers.dummy.driver import DummyConfig, DummyDriver
from drivers.multistep import run_steps
from drivers.sampler_chain import (
    Filters,
    SlotTokens,
    _dry_repeats,
    apply_chain_np,
    penalty_entries,
    sample_row_np,
    sample_row_with_state,
)

PS = 4
A, B, C = ord("a"), ord("b"), ord("c")


def _request(tokens: list[int], pages: list[int], kv_len: int, sampler: Sampler, **kw: object) -> RequestSpec:
    n = len(tokens)
    return RequestSpec(
        context_id=int(kw.pop("context_id", 1)),  # type: ignore[call-overload]
        tokens=tokens,
        positions=list(range(kv_len - n, kv_len)),
        pages=pages,
        last_page_len=kv_len - (len(pages) - 1) * PS,
        outputs=[OutputSpec(n - 1, sampler)],
        **kw,  # type: ignore[arg-type]
    )


def _penalties(**kw: float) -> Sampler:
    return dataclasses.replace(Sampler.greedy(), **kw)


def _counts(table: SlotTokens, spec: RequestSpec) -> dict[int, tuple[float, bool]]:
    """What the penalties see for `spec`'s output: token -> (count, in the repetition window)."""
    f = build_forward(1, [spec])
    table.write(f)
    e = penalty_entries(f, table)
    assert e is not None and e.counts is not None and e.repeated is not None
    return {int(t): (float(c), bool(r)) for t, c, r in zip(e.ids, e.counts, e.repeated, strict=True)}


def test_slot_tokens_follow_writes_copies_and_truncation() -> None:
    table = SlotTokens(num_pages=8, page_size=PS)
    s = _penalties(frequency_penalty=1.0)
    # A prompt of 6 tokens over pages 2, 5: the row at slot 5 counts slots 0..5.
    counts = _counts(table, _request([A, B, A, C, A, B], [2, 5], 6, s))
    assert counts == {A: (3, True), B: (2, True), C: (1, True)}
    # The next decode step writes slot 6 (the deferred-like new token) and counts it.
    assert _counts(table, _request([C], [2, 5], 7, s))[C] == (2, True)
    # A rollback to 4 slots rewrites slot 3: slots 4..6 no longer count.
    assert _counts(table, _request([B], [2, 5], 4, s)) == {A: (2, True), B: (2, True)}
    # A fork shares page 2 and copies the partial page 5 to 7: it counts its parent's tokens.
    table.copy([5], [7])
    assert _counts(table, _request([C], [2, 7], 5, s, context_id=2)) == {A: (2, True), B: (2, True), C: (1, True)}


def test_penalty_windows() -> None:
    table = SlotTokens(num_pages=8, page_size=PS)
    tokens = [A, A, B, C, B, A]  # slots 0..5
    # Presence/frequency from slot 3 (the "generated" part), repetition over all.
    s = _penalties(presence_penalty=0.5, repetition_penalty=1.5, penalty_from=3)
    assert _counts(table, _request(tokens, [0, 1], 6, s)) == {A: (1, True), B: (1, True), C: (1, True)}
    s = _penalties(presence_penalty=0.5, repetition_penalty=1.5, penalty_from=3, repetition_from=5)
    assert _counts(table, _request(tokens, [0, 1], 6, s)) == {A: (1, True), B: (1, False), C: (1, False)}
    s = _penalties(frequency_penalty=0.5, penalty_last_n=2)  # slots 4, 5
    assert _counts(table, _request(tokens, [0, 1], 6, s)) == {A: (1, True), B: (1, True)}


def test_apply_chain_np_rules() -> None:
    table = SlotTokens(num_pages=4, page_size=PS)
    s = dataclasses.replace(
        Sampler.greedy(),
        repetition_penalty=2.0,
        presence_penalty=0.25,
        frequency_penalty=0.5,
        logit_bias=((C, 1.0), (200, -100.0)),
    )
    f = build_forward(1, [_request([A, A, B], [0], 3, s)])
    table.write(f)
    logits = np.zeros((1, 260), dtype=np.float32)
    logits[0, [A, B, C, 200]] = [4.0, -2.0, 1.0, 5.0]
    out = apply_chain_np(logits, f, table)[0]
    # a: 4 / 2 - 0.25 - 2 * 0.5; b: -2 * 2 - 0.25 - 0.5; c: 1 + 1 (biased, not in the context).
    assert out[[A, B, C, 200]].tolist() == [0.75, -4.75, 2.0, -95.0]
    assert np.count_nonzero(out) == 4


def _dummy(**config: object) -> DummyDriver:
    driver = DummyDriver(DummyConfig(page_size=PS, num_pages=32, **config))  # type: ignore[arg-type]
    driver.handshake(Hello())
    return driver


def _tokens(driver: DummyDriver, specs: list[RequestSpec]) -> list[int]:
    f = build_forward(1, specs)
    return [o.token for outs in split_result(f, driver.forward(f)) for o in outs]


@pytest.mark.parametrize("random", [False, True])
def test_bias_bans_and_forces_on_the_dummy(random: bool) -> None:
    driver = _dummy()
    base = Sampler.random(temperature=1.0, seed=3) if random else Sampler.greedy()
    forced = dataclasses.replace(base, logit_bias=((B, 100.0),))
    assert _tokens(driver, [_request([A, A], [0], 2, forced)]) == [B]
    # Banning all but two tokens leaves those two (uniform logits: the draw picks between them).
    banned = dataclasses.replace(base, logit_bias=tuple((t, -100.0) for t in range(260) if t not in (A, C)))
    picks = {
        _tokens(driver, [_request([t, t], [1], 2, dataclasses.replace(banned, seed=t if random else -1))])[0]
        for t in range(40)
    }
    assert picks <= {A, C} and (picks == {A, C} or not random)


def test_scripted_logits_sample_as_the_reference() -> None:
    logits = ((A, 3.0), (B, 2.5), (C, 2.0), (7, 1.0))
    driver = _dummy(logits=logits)
    row = np.zeros(260, dtype=np.float32)
    for t, v in logits:
        row[t] = v
    assert _tokens(driver, [_request([1, 2], [0], 2, Sampler.greedy())]) == [A]
    for seed in range(12):
        s = Sampler.random(temperature=0.7, top_k=3, top_p=0.95, min_p=0.1, seed=seed)
        got = _tokens(driver, [_request([1, 2], [0], 2, s)])[0]
        from bridge_schema.sampling import seeded_uniform

        assert got == sample_row_np(row, 0.7, 3, 0.95, 0.1, float(seeded_uniform([seed], [1])[0]))
    # Probes report the distribution after the chain.
    f = build_forward(1, [RequestSpec(1, [1, 2], [0, 1], [0], 2, [OutputSpec(1, probe=Probe.LOGPROBS, probe_k=2)])])
    out = split_result(f, driver.forward(f))[0][0]
    assert out.topk_ids.tolist() == [A, B]
    expect = 3.0 - np.log(np.exp(row.astype(np.float64)).sum())
    assert out.logprob == pytest.approx(expect, abs=1e-5)


def test_penalties_steer_the_dummy_alone_and_in_multi_step() -> None:
    driver = _dummy(logits=((A, 3.0), (B, 2.6), (C, 2.2)))
    presence = _penalties(presence_penalty=1.0, penalty_from=1)
    # One step at a time: a, then b (a is down to 2), then c, then a again (presence counts once).
    said: list[int] = []
    for step in range(4):
        tokens = [0, *said]  # the prompt's one token, then each sample fed back
        pages = list(range((len(tokens) + PS - 1) // PS))
        said += _tokens(driver, [_request(tokens, pages, len(tokens), presence, context_id=step + 10)])
    assert said == [A, B, C, A]
    # The same as one multi-step request: the driver's own samples count as they are written.
    spec = RequestSpec(5, [0], [0], [8, 9], 4, [OutputSpec(j, presence) for j in range(4)], steps=4)
    f = build_forward(2, [spec])
    assert run_steps(driver.forward, f, PS).tokens.tolist() == said


def test_dummy_logits_flag() -> None:
    driver = create_driver(["--logits", "a=2,33=1.5,b=-1"])
    assert driver.config.logits == ((33, 1.5), (A, 2.0), (B, -1.0))
    with pytest.raises(SystemExit):
        create_driver(["--logits", "a:2"])


def _reachable(logits: np.ndarray, filters: Filters, top_k: int = 0, temperature: float = 1.0) -> set[int]:
    """The tokens the plain sampler can draw: one draw at each step of u over [0, 1)."""
    return {sample_row_np(logits, temperature, top_k, 1.0, 0.0, u, filters) for u in np.linspace(0, 0.999, 400)}


def test_filters_keep_what_their_rules_say() -> None:
    logits = np.array([5.0, 4.5, 4.0, 1.0, 0.5, 0.0, 0.0, -1.0], dtype=np.float32)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    assert _reachable(logits, Filters()) == set(range(8))
    # Top-n-sigma: within n (population) standard deviations of the best logit.
    sigma = float(logits.std())
    expect = {t for t in range(8) if logits[t] >= 5.0 - 0.5 * sigma}
    assert _reachable(logits, Filters(top_n_sigma=0.5)) == expect and 1 < len(expect) < 8
    # Typical: the tokens nearest the entropy in surprisal, until they hold the mass. One likely
    # token among 20 alike: the 20 are the typical ones, and it is left out.
    flat = np.array([3.0] + [1.0] * 20, dtype=np.float32)
    p = np.exp(flat - flat.max())
    p /= p.sum()
    entropy = -float(np.sum(p * np.log(p)))
    nearest = np.argsort(np.abs(-np.log(p) - entropy), kind="stable")
    held, typical = 0.0, set()
    for t in nearest.tolist():
        typical.add(t)
        held += p[t]
        if held >= 0.5:
            break
    assert _reachable(flat, Filters(typical_p=0.5)) == typical and 0 not in typical and len(typical) > 5
    # XTC: every token at least 0.15 likely but the least likely of them goes, when it fires.
    above = [t for t in range(8) if probs[t] >= 0.15]
    assert len(above) >= 2
    fired = _reachable(logits, Filters(xtc_probability=0.5, xtc_threshold=0.15, xtc_draw=0.2))
    assert fired == set(range(8)) - set(above[:-1])
    assert _reachable(logits, Filters(xtc_probability=0.5, xtc_threshold=0.15, xtc_draw=0.7)) == set(range(8))
    # One token above the threshold: XTC leaves it.
    assert 0 in _reachable(logits, Filters(xtc_probability=1.0, xtc_threshold=0.5, xtc_draw=0.0))


def test_filters_on_the_dummy_match_the_reference() -> None:
    logits = ((A, 3.0), (B, 2.6), (C, 2.2), (7, 1.0))
    driver = _dummy(logits=logits)
    row = np.zeros(260, dtype=np.float32)
    for t, v in logits:
        row[t] = v
    from bridge_schema.sampling import seeded_uniform, xtc_uniform

    for seed in range(16):
        s = dataclasses.replace(
            Sampler.random(temperature=0.4, seed=seed),
            typical_p=0.9,
            top_n_sigma=1.5,
            xtc_probability=0.5,
            xtc_threshold=0.2,
        )
        got = _tokens(driver, [_request([1, 2], [0], 2, s)])[0]
        u, xtc = float(seeded_uniform([seed], [1])[0]), float(xtc_uniform([seed], [1])[0])
        assert got == sample_row_np(row, 0.4, 0, 1.0, 0.0, u, Filters(0.9, 1.5, 0.5, 0.2, xtc))


def test_mirostat_truncates_by_surprise_and_moves_mu() -> None:
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32))  # surprises 1, 2, 3, 3 bits
    # mu 2.5: only the 1- and 2-bit tokens stay; the draw picks among them (2/3, 1/3).
    low = Filters(mirostat_tau=2.0, mirostat_eta=0.5, mirostat_mu=2.5)
    assert {sample_row_with_state(logits, 1.0, 0, 1.0, 0.0, u, low)[0] for u in np.linspace(0, 0.99, 50)} == {0, 1}
    token, mu = sample_row_with_state(logits, 1.0, 0, 1.0, 0.0, 0.9, low)
    # Token 1 drawn: its surprise among the kept is log2(3) bits; mu moves by 0.5 * (that - 2).
    assert token == 1 and mu == pytest.approx(2.5 - 0.5 * (np.log2(3) - 2.0))
    # mu below every surprise: the most likely token alone.
    assert sample_row_with_state(logits, 1.0, 0, 1.0, 0.0, 0.99, Filters(mirostat_tau=1.0, mirostat_mu=0.5))[0] == 0
    assert np.isnan(sample_row_with_state(logits, 1.0, 0, 1.0, 0.0, 0.5)[1])


def test_mirostat_state_follows_the_slots_on_the_dummy() -> None:
    """mu lives in the slot of each step's input: the next step reads it, a fork continues from
    its parent's, and rewriting a slot starts over at 2 * tau."""
    from bridge_schema.sampling import seeded_uniform

    logits = ((A, 3.0), (B, 2.6), (C, 2.2), (7, 1.0))  # 3.9, 4.5, 5.0, 6.1 bits; the rest 8.2
    driver = _dummy(logits=logits)
    table = driver._slot_tokens
    row = np.zeros(260, dtype=np.float32)
    for t, v in logits:
        row[t] = v
    tau, eta = 3.0, 0.8
    s = dataclasses.replace(Sampler.random(temperature=1.0, seed=4), mirostat_tau=tau, mirostat_eta=eta)

    def step(mu: float, position: int) -> tuple[int, float]:
        u = float(seeded_uniform([4], [position])[0])
        return sample_row_with_state(
            row, 1.0, 0, 1.0, 0.0, u, Filters(mirostat_tau=tau, mirostat_eta=eta, mirostat_mu=mu)
        )

    expect, mus, mu = [], [], 2 * tau
    for position in range(1, 9):
        token, mu = step(mu, position)
        expect.append(token)
        mus.append(mu)
    # The prompt [1, 2] on pages 0, 1, then one token a step, as a context decodes.
    said = _tokens(driver, [_request([1, 2], [0], 2, s)])
    for kv in range(3, 10):
        said += _tokens(driver, [_request(said[-1:], [0, 1, 2][: -(-kv // PS)], kv, s)])
    assert said == expect and len(set(said)) > 1
    # A fork after the step at slot 3 (page 0 shared; slot 4 on page 5): the parent's next token,
    # and the mu the parent's step at slot 4 left; from 2 * tau the mu would differ.
    forked = _tokens(driver, [_request([said[2]], [0, 5], 5, s, context_id=9)])
    assert forked == said[3:4] and table.mu[5 * PS] == pytest.approx(mus[3])
    assert step(2 * tau, 4)[1] != pytest.approx(mus[3])
    # Rewriting the slots from the prompt on starts mu afresh.
    again = _tokens(driver, [_request([1, 2, *said[:2]], [0], 4, s)])
    assert again == [step(2 * tau, 3)[0]] and table.mu[3] == pytest.approx(step(2 * tau, 3)[1])


def _dry_brute(window: list[int], breakers: set[int]) -> list[int]:
    """DRY's repeat lengths by its definition, one position at a time."""
    n = len(window)
    cut = [i for i, t in enumerate(window) if t < 0 or t in breakers]
    limit = n - 1 - cut[-1] if cut else n
    lengths = []
    for e in range(n - 1):
        k = 0
        while k < limit and e - k >= 0 and window[e - k] == window[n - 1 - k]:
            k += 1
        lengths.append(k)
    return lengths


def test_dry_repeat_lengths_equal_their_definition() -> None:
    rng = np.random.default_rng(7)
    for trial in range(300):
        window = rng.integers(-1 if trial % 5 == 0 else 0, 3, size=int(rng.integers(0, 40))).tolist()
        breakers = {2} if trial % 3 == 0 else set()
        got = _dry_repeats(np.array(window, dtype=np.int64), np.array(sorted(breakers), dtype=np.int64))
        assert got.tolist() == _dry_brute(window, breakers), (window, breakers)


def test_dry_rule() -> None:
    table = SlotTokens(num_pages=4, page_size=PS)
    tokens = [A, B, C, 9, A, B, C, 9, A, B]  # "a b" ends it and was followed by c twice
    logits = np.zeros((1, 260), dtype=np.float32)
    # c follows "b" twice: after slot 1 (a repeat of 2: "a b") and after slot 5, where the run
    # "a b c 9 a b" equals the tail's: 6 tokens. c takes the longer.
    for allowed in (2, 4, 6, 7):
        s = _penalties(dry_multiplier=2.0, dry_base=1.5, dry_allowed_length=allowed)
        f = build_forward(1, [_request(tokens, [0, 1, 2], 10, s)])
        table.write(f)
        out = apply_chain_np(logits, f, table)[0]
        expect = 2.0 * 1.5 ** (6 - allowed) if allowed <= 6 else 0.0
        assert out[C] == pytest.approx(-expect) and np.count_nonzero(out) == (1 if expect else 0), allowed
    s = _penalties(dry_multiplier=2.0, dry_base=1.5, dry_allowed_length=2, dry_breakers=(9,))
    f = build_forward(1, [_request(tokens, [0, 1, 2], 10, s)])
    table.write(f)
    out = apply_chain_np(logits, f, table)[0]
    assert out[C] == pytest.approx(-2.0)  # the breaker 9 limits the repeat to "a b": 1.5 ** 0
    s = _penalties(dry_multiplier=2.0, dry_base=1.5, dry_allowed_length=2, dry_last_n=5)
    f = build_forward(1, [_request(tokens, [0, 1, 2], 10, s)])
    table.write(f)
    assert np.count_nonzero(apply_chain_np(logits, f, table)[0]) == 0  # "b c 9 a b": b repeats 1 < 2


def test_dry_steers_the_dummy_alone_and_in_multi_step() -> None:
    driver = _dummy(logits=((A, 3.0), (B, 2.9), (C, 2.8)))
    dry = _penalties(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=1)
    said: list[int] = []
    for step in range(6):
        tokens = [0, *said]
        pages = list(range((len(tokens) + PS - 1) // PS))
        said += _tokens(driver, [_request(tokens, pages, len(tokens), dry, context_id=step + 10)])
    assert said != [A] * 6 and said[:2] == [A, A]  # the second a starts a repeat: DRY steps in
    spec = RequestSpec(5, [0], [0], [8, 9], 4, [OutputSpec(j, dry) for j in range(6)], steps=6)
    f = build_forward(2, [spec])
    assert run_steps(driver.forward, f, PS).tokens.tolist() == said
