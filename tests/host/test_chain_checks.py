"""The host refuses a sampler chain the driver would refuse, where the pass enters the host
(`host.engine.pass_check`), naming what is wrong; a valid chain passes."""

from __future__ import annotations

import dataclasses

import pytest

from bridge_schema.batch import OutputSpec, Sampler
from bridge_schema.messages import SAMPLER_CHAIN, Handshake
from host.engine.pass_check import check_request
from host.errors import InvalidRequest
from host.services import PassRequest

HANDSHAKE = Handshake(
    driver_kind="dummy",
    vocab_size=260,
    page_size=16,
    num_pages=64,
    max_context=512,
    max_requests_per_pass=64,
    max_tokens_per_pass=4096,
    max_mask_bytes=1 << 20,
    max_probe_k=20,
    capabilities=[SAMPLER_CHAIN],
)


def _check(**chain: object) -> None:
    sampler = dataclasses.replace(Sampler.greedy(), **chain)  # type: ignore[arg-type]
    check_request(PassRequest(tokens=[1, 2], outputs=[OutputSpec(1, sampler)]), 0, HANDSHAKE, set())


def test_a_valid_chain_passes() -> None:
    _check(presence_penalty=1.0, logit_bias=((3, 1.0),), dry_multiplier=0.8, dry_breakers=(10, 13))


@pytest.mark.parametrize(
    ("chain", "said"),
    [
        ({"repetition_penalty": 0.0}, "repetition penalty > 0"),
        ({"logit_bias": ((5, 1.0), (3, 1.0))}, "rising order"),
        ({"logit_bias": ((300, 1.0),)}, "rising order"),
        ({"typical_p": 0.0}, "typical_p in (0, 1]"),
        ({"dry_multiplier": 0.8, "dry_base": 0.5}, "DRY out of range"),
        ({"dry_multiplier": 0.8, "dry_breakers": (260,)}, "each a token of [0, 260)"),
        ({"dry_multiplier": 0.8, "dry_allowed_length": -1}, "DRY out of range"),
        ({"dry_multiplier": float("inf")}, "DRY out of range"),
    ],
)
def test_an_invalid_chain_is_refused_naming_it(chain: dict[str, object], said: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        _check(**chain)
    assert said in str(info.value)


def test_a_driver_without_chains_refuses_them() -> None:
    plain = dataclasses.replace(HANDSHAKE, capabilities=[])
    sampler = dataclasses.replace(Sampler.greedy(), dry_multiplier=1.0)
    with pytest.raises(InvalidRequest, match="does not run sampler chains"):
        check_request(PassRequest(tokens=[1], outputs=[OutputSpec(0, sampler)]), 0, plain, set())
