"""RoPE kinds (`rope.py`) as transformers computes them: the inverse frequencies and attention
factor of each kind equal to transformers' ROPE_INIT_FUNCTIONS, and tiny random checkpoints that
transformers saves with each kind decoding (a prefill, then one token per pass over the paged
cache) within 1e-4 of transformers' forward. Factors and original lengths are chosen so that each
kind moves the logits far from the default RoPE (positions past a small original length), and the
length-dependent kinds are compared where the driver's choice (`rope.py`'s docstring) is the one
transformers makes: dynamic NTK within `max_position_embeddings`, LongRoPE's long factors past
the original length and its short ones where `max_position_embeddings` does not exceed it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from drivers.errors import ConfigRejected
from drivers.torch.families import hf_config
from drivers.torch.rope import hf_rope_fields, model_attention_factors, model_inv_freqs, rope_inv_freq
from drivers.torch.runners import fused_decode
from tests.drivers.torch.helpers import TINY_SHAPE, load_dir, make_driver, needs_kernel, write_tiny_family
from tests.drivers.torch.test_families import PAGE_SIZE, PAGES, STEPS, _assert_decode_matches_transformers, _driver

FACTORS = dict(short_factor=[1.0 + i / 4 for i in range(8)], long_factor=[1.5 + i for i in range(8)])
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, **FACTORS)
HALF_LONGROPE = dict(LONGROPE, short_factor=FACTORS["short_factor"][:4], long_factor=FACTORS["long_factor"][:4])

# Per case: the family and its settings; each decodes 33 tokens (test_families' PROMPT + STEPS).
CASES: dict[str, tuple[str, dict[str, object]]] = {
    "linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    # Up to max_position_embeddings (the driver's longest context) dynamic NTK is the default RoPE.
    "dynamic": (
        "llama",
        dict(max_position_embeddings=40, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)),
    ),
    "yarn": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, beta_fast=8.0
            )
        ),
    ),
    # Phi-3.5-like: max_position 256 > original 8, so the long factors throughout (transformers
    # takes them too: the sequence is longer than 8); every layer windowed, half of each head rotated.
    "longrope-long": (
        "phi3",
        dict(
            original_max_position_embeddings=8,
            sliding_window=12,
            partial_rotary_factor=0.5,
            rope_parameters=HALF_LONGROPE,
        ),
    ),
    # max_position = original = 40: the short factors, the attention factor from the explicit factor.
    "longrope-short": (
        "phi3",
        dict(
            original_max_position_embeddings=40, max_position_embeddings=40, rope_parameters=dict(LONGROPE, factor=4.0)
        ),
    ),
    # Gemma 3 4B+: linear scaling of the global layers only, the windowed layers' own base unscaled.
    "gemma3-linear": (
        "gemma3_text",
        dict(
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": dict(rope_type="linear", rope_theta=10000.0, factor=8.0),
                "sliding_attention": dict(rope_type="default", rope_theta=1000.0),
            },
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    family, settings = CASES[name]
    return name, write_tiny_family(tmp_path_factory.mktemp(name) / "m", family, **settings)


def test_prefill_and_decode_match_transformers(case: tuple[str, Path]) -> None:
    name, path = case
    drv = make_driver(load_dir(path), page_size=PAGE_SIZE, num_pages=len(PAGES))
    _assert_decode_matches_transformers(drv, path, seed=len(name))


def test_the_scaled_kinds_differ_from_the_default_rope(case: tuple[str, Path]) -> None:
    """Each case's kind moves the model's frequencies far from the default RoPE's (dynamic NTK
    only past max_position, which the driver does not serve), and YaRN's and LongRoPE's cos/sin."""
    name, path = case
    cfg = load_dir(path).cfg
    assert cfg.rope_scaling is not None
    default = rope_inv_freq(cfg.rope_dim, cfg.rope_theta)
    length = 4 * cfg.max_position if name == "dynamic" else cfg.max_position
    scaled = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, length)
    assert not torch.allclose(scaled, default, rtol=0.1)
    if name.startswith(("yarn", "longrope")):
        assert model_attention_factors(cfg)[0] > 1.05


def test_fused_decode_refuses_an_attention_factor(case: tuple[str, Path]) -> None:
    """The fused C++ step computes cos and sin from inv_freq alone: YaRN and LongRoPE (without
    windows) are refused by their attention factor, so the driver keeps the model's path."""
    name, path = case
    if name not in ("yarn", "longrope-short"):
        pytest.skip("the fused step refuses this case for its windows, or takes it")
    drv = make_driver(load_dir(path), page_size=PAGE_SIZE, num_pages=len(PAGES))
    assert drv.cache is not None and drv.fused is None
    assert fused_decode.unsupported(drv.model, drv.cache) == "a RoPE attention factor (YaRN, LongRoPE)"


@needs_kernel
def test_linear_scaling_decodes_in_the_fused_step(tmp_path: Path) -> None:
    """The fused step rotates by the model's (scaled) inv_freq."""
    family, settings = CASES["linear"]
    path = write_tiny_family(tmp_path / "m", family, **settings)
    drv = make_driver(load_dir(path), page_size=PAGE_SIZE, num_pages=len(PAGES))
    assert drv.fused is not None
    _assert_decode_matches_transformers(drv, path, seed=5)
    assert drv.fused.passes == STEPS


def test_compiled_graphs_take_the_attention_factor(tmp_path: Path) -> None:
    """The compiled graphs call the model's `embed`: LongRoPE's factors and attention factor over
    half of each head, on windowed layers, as in transformers (the slowest test here: it compiles)."""
    family, settings = CASES["longrope-long"]
    path = write_tiny_family(tmp_path / "m", family, **settings)
    drv = _driver(load_dir(path), compile=True)
    assert drv.compiled is not None
    _assert_decode_matches_transformers(drv, path, seed=3)


# ---------------------------------------------------------------- frequencies


def _hf(model_type: str, rope_parameters: dict[str, Any], **extra: object) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY_SHAPE, **extra, "rope_parameters": dict(rope_parameters)})


KINDS: list[tuple[str, str, dict[str, Any], dict[str, object]]] = [
    ("linear", "llama", dict(rope_type="linear", rope_theta=10000.0, factor=4.0), {}),
    ("dynamic", "llama", dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0), {}),
    ("yarn", "llama", dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16), {}),
    (
        "yarn-mscale",
        "llama",
        dict(
            rope_type="yarn",
            rope_theta=500000.0,
            factor=8.0,
            original_max_position_embeddings=32,
            beta_fast=16.0,
            beta_slow=2.0,
            mscale=0.7,
            mscale_all_dim=0.5,
            truncate=False,
        ),
        {},
    ),
    (
        "yarn-implicit-factor",
        "llama",
        dict(rope_type="yarn", rope_theta=10000.0, factor=None, original_max_position_embeddings=64),
        {},
    ),
    (
        "llama3",
        "llama",
        dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        {},
    ),
    ("longrope", "phi3", LONGROPE, dict(original_max_position_embeddings=32)),
    (
        "longrope-partial",
        "phi3",
        HALF_LONGROPE,
        dict(original_max_position_embeddings=32, partial_rotary_factor=0.5),
    ),
]


@pytest.mark.parametrize(("name", "model_type", "rope", "extra"), KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("seq_len", [0, 20, 256, 1000])
def test_inverse_frequencies_and_attention_factor_equal_transformers(
    name: str, model_type: str, rope: dict[str, Any], extra: dict[str, object], seq_len: int
) -> None:
    """Bit for bit, at lengths below, at and past the original and max_position (256) lengths:
    dynamic NTK's growing base and LongRoPE's short/long switch included."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hc = _hf(model_type, rope, **extra)
    fields = hf_rope_fields(hc.to_dict(), int(TINY_SHAPE["head_dim"]))  # type: ignore[call-overload]
    want, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hc, "cpu", seq_len=seq_len or None)
    scaling = fields["rope_scaling"]
    dim = int(16 * float(extra.get("partial_rotary_factor", 1.0)))  # type: ignore[arg-type]
    assert torch.equal(rope_inv_freq(dim, fields["rope_theta"], scaling, seq_len), want)
    assert scaling.attention_factor == factor


def test_the_driver_takes_the_frequencies_of_its_longest_context() -> None:
    """LongRoPE's long factors where max_position exceeds the original length, short ones where
    it does not; dynamic NTK's base at max_position, which is theta."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for original, long in ((32, True), (256, False)):
        raw = dict(model_type="phi3", original_max_position_embeddings=original, rope_parameters=LONGROPE, **TINY_SHAPE)
        cfg = hf_config(raw, "m")
        hc = _hf("phi3", LONGROPE, original_max_position_embeddings=original)
        want, factor = ROPE_INIT_FUNCTIONS["longrope"](hc, "cpu", seq_len=original + 1 if long else original)
        full, local = model_inv_freqs(cfg)
        assert torch.equal(full, want) and torch.equal(local, want)
        assert model_attention_factors(cfg) == (factor, factor)
    cfg = hf_config(dict(model_type="llama", rope_parameters=CASES["dynamic"][1]["rope_parameters"], **TINY_SHAPE), "m")
    assert torch.equal(model_inv_freqs(cfg)[0], rope_inv_freq(cfg.rope_dim, cfg.rope_theta))


def test_phi3_names_for_longrope_and_its_top_level_original_length_are_read() -> None:
    """Phi-3's older configs call LongRoPE "su"; its original length is read from the top level."""
    raw = dict(
        model_type="phi3",
        original_max_position_embeddings=32,
        rope_scaling=dict(type="su", short_factor=FACTORS["short_factor"], long_factor=FACTORS["long_factor"]),
        rope_theta=10000.0,
        **TINY_SHAPE,
    )
    s = hf_config(raw, "m").rope_scaling
    assert s is not None and (s.kind, s.original_max_position, s.factor) == ("longrope", 32, 8.0)


def test_longrope_factors_not_one_per_rotated_pair_are_refused() -> None:
    rope = dict(LONGROPE, short_factor=[1.0] * 3)
    with pytest.raises(ConfigRejected, match="longrope needs 8 short and long factors"):
        hf_config(dict(model_type="phi3", rope_parameters=rope, **TINY_SHAPE), "m")


def test_scaled_rope_on_windowed_layers_with_their_own_base_is_refused() -> None:
    rope = {
        "full_attention": dict(rope_type="default", rope_theta=10000.0),
        "sliding_attention": dict(rope_type="linear", rope_theta=1000.0, factor=2.0),
    }
    with pytest.raises(ConfigRejected, match="of windowed layers"):
        hf_config(dict(model_type="gemma3_text", rope_parameters=rope, **TINY_SHAPE), "m")
