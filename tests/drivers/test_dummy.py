"""The dummy driver samples like a real driver: within the logit mask, uniformly, reproducibly."""

from __future__ import annotations

import numpy as np
import pytest

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward, pack_allowed, split_result
from bridge_schema.messages import Adapter, Copy, Hello, Probe
from drivers.dummy import DummyConfig, DummyDriver
from drivers.errors import ConfigRejected, RequestRejected


def _driver(seed: int = 0) -> DummyDriver:
    d = DummyDriver(DummyConfig(seed=seed))
    d.handshake(Hello(page_size=16))
    return d


def _rows_request(n_rows: int, sampler: Sampler, mask: np.ndarray | None, start_pos: int = 0) -> RequestSpec:
    """One request of n_rows tokens, every row sampled."""
    pages = list(range((n_rows + 15) // 16))
    return RequestSpec(
        context_id=1,
        tokens=[65] * n_rows,
        positions=list(range(start_pos, start_pos + n_rows)),
        pages=pages,
        last_page_len=n_rows - (len(pages) - 1) * 16,
        outputs=[OutputSpec(i, sampler, logit_mask=mask) for i in range(n_rows)],
    )


def _sample(d: DummyDriver, spec: RequestSpec) -> np.ndarray:
    f = build_forward(1, [spec])
    return np.array([o.token for o in split_result(f, d.forward(f))[0]])


def test_never_samples_outside_the_logit_mask() -> None:
    d, rng = _driver(), np.random.default_rng(1)
    for trial in range(50):
        allowed = rng.choice(260, size=rng.integers(1, 40), replace=False)
        mask = pack_allowed(260, allowed)
        sampler = Sampler.random(seed=trial) if trial % 2 else Sampler.greedy()
        tokens = _sample(d, _rows_request(64, sampler, mask))
        assert set(tokens.tolist()) <= set(allowed.tolist())


@pytest.mark.parametrize("seeded", [False, True])
def test_uniform_over_the_allowed_set(seeded: bool) -> None:
    d = _driver()
    allowed = np.array([3, 40, 41, 99, 100, 150, 200, 255, 256, 259])
    mask = pack_allowed(260, allowed)
    counts = np.zeros(260)
    for p in range(10):
        sampler = Sampler.random(seed=1234) if seeded else Sampler.random()
        np.add.at(counts, _sample(d, _rows_request(500, sampler, mask, start_pos=p * 500)), 1)
    observed = counts[allowed]
    expected = counts.sum() / len(allowed)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert counts.sum() == observed.sum() == 5000
    assert chi2 < 27.88  # chi-square, 9 degrees of freedom, p = 0.001


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    spec = _rows_request(64, Sampler.random(seed=42), None)
    a, b = _sample(_driver(seed=1), spec), _sample(_driver(seed=2), spec)
    np.testing.assert_array_equal(a, b)
    c = _sample(_driver(seed=1), _rows_request(64, Sampler.random(seed=43), None))
    assert (a != c).any()
    assert len(set(a.tolist())) > 16  # successive positions draw differently


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    d = _driver()
    alone = build_forward(1, [_rows_request(8, Sampler.random(seed=5), None)])
    others = [_rows_request(4, Sampler.random(), None) for _ in range(3)]
    batched = build_forward(2, [*others, _rows_request(8, Sampler.random(seed=5), None)])
    tokens_alone = [o.token for o in split_result(alone, d.forward(alone))[0]]
    tokens_batched = [o.token for o in split_result(batched, d.forward(batched))[-1]]
    assert tokens_alone == tokens_batched


def test_probe_outputs_are_shaped() -> None:
    d = _driver()
    mask = pack_allowed(260, [7, 8, 9])
    spec = RequestSpec(
        1,
        [1, 2],
        [0, 1],
        [0],
        2,
        [
            OutputSpec(0, probe=Probe.LOGPROBS, probe_k=5),
            OutputSpec(1, probe=Probe.LOGPROBS | Probe.DISTRIBUTION, probe_k=5, logit_mask=mask),
        ],
    )
    f = build_forward(1, [spec])
    first, second = split_result(f, d.forward(f))[0]
    assert len(first.topk_ids) == 5 and first.logprob == pytest.approx(-np.log(260))
    assert second.topk_ids.tolist() == [7, 8, 9] and second.logprob == pytest.approx(-np.log(3))
    assert second.distribution is not None and second.distribution.shape == (260,)
    assert np.isclose(np.exp(second.distribution).sum(), 1.0)
    assert first.distribution is None


def test_a_scored_row_reports_its_tokens_logprob() -> None:
    """Uniform over the allowed tokens: a scored token inside them has -log(n), outside -inf."""
    d = _driver()
    mask = pack_allowed(260, [7, 8, 9])
    outputs = [
        OutputSpec(0, probe=Probe.LOGPROBS, score_token=200),
        OutputSpec(1, probe=Probe.LOGPROBS, logit_mask=mask, score_token=8),
        OutputSpec(2, probe=Probe.LOGPROBS, logit_mask=mask, score_token=200),
    ]
    f = build_forward(1, [RequestSpec(1, [1, 2, 3], [0, 1, 2], [0], 3, outputs)])
    results = split_result(f, d.forward(f))[0]
    assert [r.logprob for r in results[:2]] == pytest.approx([-np.log(260), -np.log(3)])
    assert results[2].logprob == -np.inf


def test_copy_and_adapter_are_acknowledged_and_counted() -> None:
    d = _driver()
    d.copy(Copy(src_pages=np.array([1], np.uint32), dst_pages=np.array([2], np.uint32)))
    d.adapter(Adapter(op="load", adapter_id=4, path="/nowhere"))
    f = build_forward(1, [RequestSpec(1, [1], [0], [0], 1, [OutputSpec(0)], adapter_id=4)])
    assert len(d.forward(f).tokens) == 1
    d.adapter(Adapter(op="unload", adapter_id=4))
    with pytest.raises(RequestRejected, match="adapter 4"):
        d.forward(f)
    assert d.health()["pages_copied"] == 1 and d.health()["adapter_loads"] == 1


def test_mask_that_allows_nothing_is_rejected() -> None:
    d = _driver()
    with pytest.raises(RequestRejected, match="allows no token"):
        _sample(d, _rows_request(1, Sampler.greedy(), pack_allowed(260, [])))


def test_handshake_resolves_and_validates_configuration() -> None:
    d = DummyDriver()
    assert d.handshake(Hello(page_size=32, num_pages=10)).page_size == 32
    assert d.handshake(Hello(prefix_match_unit=16, speculation_depth=1)).page_size == 16
    with pytest.raises(ConfigRejected, match="prefix_match_unit"):
        d.handshake(Hello(page_size=16, prefix_match_unit=8, speculation_depth=1))


def test_a_pass_that_samples_nothing_gets_an_empty_reply() -> None:
    """A prefill chunk that is not its fill's last has no output rows."""
    f = build_forward(1, [RequestSpec(1, [1, 2, 3], [0, 1, 2], [0], 3, [])])
    result = _driver().forward(f)
    assert len(result.tokens) == len(result.logprobs) == 0
    assert result.topk_indptr.tolist() == result.dist_indptr.tolist() == [0]


def test_a_script_is_said_in_order_per_context_then_end_of_text() -> None:
    d = DummyDriver(DummyConfig(script=tuple(b"hi")))
    d.handshake(Hello(page_size=16))

    def step(context: int, position: int, token: int = 65, mask: np.ndarray | None = None) -> int:
        spec = RequestSpec(context, [token], [position], [context], position + 1, [OutputSpec(0, logit_mask=mask)])
        f = build_forward(1, [spec])
        return split_result(f, d.forward(f))[0][0].token

    h = step(1, 0)
    i = step(1, 1, h)
    assert [h, i, step(1, 2, i)] == [ord("h"), ord("i"), 256]  # then ENDOFTEXT
    assert step(1, 1, h) == ord("i")  # a position sampled again (a retried step): the same token
    # The context went on with another token than the one sampled at 0 (that sample was
    # discarded, as a staged step the inferlet never used): the script resumes from there.
    assert step(1, 1, 66) == ord("h")
    assert step(2, 5) == ord("h")  # another context starts the script
    assert step(3, 0, mask=pack_allowed(260, [7, 8])) in (7, 8)  # a mask refusing the script wins
    assert step(1, 2, ord("h")) == ord("i")  # context 1 said "h" at 1: "i" next
    d.handshake(Hello(page_size=16))  # a new host: its context 1 is another context
    assert step(1, 2, ord("h")) == ord("h")
