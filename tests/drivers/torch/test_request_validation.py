"""Bad requests get a `RequestRejected` naming the field, and the driver keeps serving. A mask
shorter (or longer) than the keys it must cover is never applied silently, padded, dropped, and
never crashes the driver."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bridge_schema.messages import Forward
from drivers.errors import RequestRejected
from drivers.torch.driver import TorchDriver
from drivers.torch.errors import MaskShapeError
from drivers.torch.kernels.attention_ref import masked_attention
from tests.drivers.torch.helpers import brle, forward, load_dir, make_driver, random_tokens, request, write_tiny_gemma

PAGES = list(range(8))


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> TorchDriver:
    path = write_tiny_gemma(tmp_path_factory.mktemp("gemma") / "m", sliding_window=4)
    return make_driver(load_dir(path), page_size=4, num_pages=8)


def _still_serves(drv: TorchDriver) -> None:
    res = drv.forward(forward([request(random_tokens(5, 96, 0), 0, PAGES, 4)]))
    assert res.tokens.shape == (1,)


@pytest.mark.parametrize("delta", [-1, +1, -6])
def test_mask_not_covering_kv_len_is_rejected(driver: TorchDriver, delta: int) -> None:
    toks = random_tokens(10, 96, 1)
    # Continuation chunk: 10 keys in the cache, windowed layers return fewer than that.
    rows = [brle([True] * (10 + delta)) for _ in range(2)]
    with pytest.raises(RequestRejected) as err:
        driver.forward(forward([request(toks[8:], 8, PAGES, 4, mask_rows=rows)]))
    assert err.value.field == "mask_runs"
    _still_serves(driver)


def test_wrong_number_of_mask_rows_is_rejected(driver: TorchDriver) -> None:
    rows = [brle([True] * 10)]
    with pytest.raises(RequestRejected) as err:
        driver.forward(forward([request(random_tokens(2, 96, 1), 8, PAGES, 4, mask_rows=rows)]))
    assert err.value.field == "mask_req_indptr"
    _still_serves(driver)


def test_attention_refuses_a_mask_that_does_not_cover_its_keys() -> None:
    q = torch.randn(1, 2, 4, 8)
    k = v = torch.randn(1, 6, 2, 8)
    with pytest.raises(MaskShapeError):
        masked_attention(q, k, v, torch.ones(1, 2, 5, dtype=torch.bool), 0.3)  # would broadcast-fail or drop
    with pytest.raises(MaskShapeError):
        masked_attention(q, k, v, torch.ones(1, 2, 1, dtype=torch.bool), 0.3)  # would broadcast silently


def _bad(f: Forward, name: str, value: np.ndarray) -> Forward:
    setattr(f, name, value)
    return f


def test_fields_checked_against_model_and_cache(driver: TorchDriver) -> None:
    ok = request(random_tokens(3, 96, 2), 0, PAGES, 4)
    cases = {
        "tokens": lambda f: _bad(f, "tokens", np.array([1, 2, 96], np.uint32)),
        "positions": lambda f: _bad(f, "positions", np.array([0, 1, 32], np.uint32)),
        "pages": lambda f: _bad(f, "pages", np.array([8], np.uint32)),
        "adapter_ids": lambda f: _bad(f, "adapter_ids", np.array([3], np.int32)),
        "out_rows": lambda f: _bad(f, "out_rows", np.array([3], np.uint32)),
        "probe_k": lambda f: _bad(f, "probe_k", np.array([21], np.uint32)),
        "last_page_len": lambda f: _bad(f, "last_page_len", np.array([2], np.uint32)),
    }
    for field, corrupt in cases.items():
        with pytest.raises(RequestRejected) as err:
            driver.forward(corrupt(forward([ok])))
        assert err.value.field == field
    _still_serves(driver)


def test_logit_mask_allowing_nothing_is_rejected(driver: TorchDriver) -> None:
    from bridge_schema.batch import OutputSpec

    empty = np.zeros(3, np.uint32)
    spec = request(random_tokens(3, 96, 2), 0, PAGES, 4, outputs=[OutputSpec(row=2, logit_mask=empty)])
    with pytest.raises(RequestRejected) as err:
        driver.forward(forward([spec]))
    assert err.value.field == "logit_masks"
    _still_serves(driver)


def test_bad_sampling_is_refused_before_the_model_runs(
    driver: TorchDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bridge_schema.batch import OutputSpec, Sampler

    ran: list[object] = []
    monkeypatch.setattr(driver, "run_model", lambda *args: ran.append(args))
    tokens = random_tokens(3, 96, 2)
    for mask, message in ((np.zeros(3, np.uint32), "allows no token"), (np.ones(2, np.uint32), "rows of 3 words")):
        spec = request(tokens, 0, PAGES, 4, outputs=[OutputSpec(row=2, logit_mask=mask)])
        with pytest.raises(RequestRejected, match=message):
            driver.forward(forward([spec]))
    for temperature in (0.0, -1.0, float("nan")):
        with pytest.raises(RequestRejected, match="temperature must be > 0"):
            driver.forward(forward([request(tokens, 0, PAGES, 4, sampler=Sampler.random(temperature))]))
    assert not ran  # nothing computed, no K/V written


def test_unknown_adapter_unload_is_rejected(tmp_path: Path, driver: TorchDriver) -> None:
    from bridge_schema.messages import Adapter

    with pytest.raises(RequestRejected) as err:
        driver.adapter(Adapter(op="unload", adapter_id=9))
    assert err.value.field == "adapter_id"
    with pytest.raises(RequestRejected) as err:
        driver.adapter(Adapter(op="load", adapter_id=9, path=str(tmp_path)))
    assert err.value.field == "path"


def test_forward_decoded_from_a_frame(driver: TorchDriver) -> None:
    """Arrays decoded from a frame are read-only; the driver must not warn or fail on them."""
    from bridge_schema.batch import OutputSpec, Sampler, pack_allowed
    from bridge_schema.codec import decode, encode
    from bridge_schema.messages import Probe

    rows = [brle([True] * (i + 1) + [False] * (5 - i)) for i in range(6)]
    outputs = [
        OutputSpec(row=4, sampler=Sampler.random(0.8, top_k=5, seed=3), probe=Probe.LOGPROBS, probe_k=3),
        OutputSpec(row=5, logit_mask=pack_allowed(96, [1, 2, 3]), probe=Probe.DISTRIBUTION),
    ]
    spec = request(random_tokens(6, 96, 3), 0, PAGES, 4, mask_rows=rows, outputs=outputs)
    f = decode(encode(forward([spec])))
    assert isinstance(f, Forward) and not f.tokens.flags.writeable
    assert driver.forward(f).tokens.tolist() == driver.forward(forward([spec])).tokens.tolist()
