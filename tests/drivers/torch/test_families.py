"""Each family of `drivers/torch/families/` on a tiny random checkpoint that transformers itself
builds and saves: logits within 1e-4 of transformers' forward over a prefill and 16 decode steps,
a prefill in chunks equal to one pass, each fast path either running the family or refusing it
(the driver then keeps the model's own path), w8a8 close to float32, tensor-parallel shards equal
to the whole model, and configs the shared transformer cannot run refused by name. Each family's
settings make its difference show: its test fails without it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from bridge_schema.messages import Hello
from drivers.errors import ConfigRejected
from drivers.torch.driver import DriverOptions, TorchDriver, build_model
from drivers.torch.families import hf_config
from drivers.torch.parallel.tensor_parallel import check_tensor_parallel, shard_checkpoint
from drivers.torch.runners import compiled
from drivers.torch.weights.checkpoint import Checkpoint
from drivers.torch.weights.smoothing import causal_attention
from tests.drivers.torch.helpers import (
    TINY_SHAPE,
    chunked_logits,
    forward,
    hf_model,
    load_dir,
    make_driver,
    needs_kernel,
    random_tokens,
    request,
    write_tiny_family,
)

# Per family: the settings of its tiny checkpoint, chosen so that its difference is large.
FAMILIES: dict[str, dict[str, object]] = {
    "qwen3": {},
    "olmo2": {},
    "granite": dict(embedding_multiplier=3.0, attention_multiplier=0.1, residual_multiplier=0.4, logits_scaling=2.5),
    "smollm3": dict(no_rope_layers=[1, 0, 1, 0]),
    "phi3": dict(sliding_window=8, partial_rotary_factor=0.5),  # Phi-4-mini rotates 3/4 of each head
    "gemma2": dict(
        sliding_window=4,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
}
PAGE_SIZE = 4
PAGES = list(range(32))[::-1]  # out of order: the page table, not adjacency, must count
PROMPT, STEPS = 17, 16


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, write_tiny_family(tmp_path_factory.mktemp(name) / "m", name, **FAMILIES[name])


def _assert_decode_matches_transformers(drv: TorchDriver, path: Path, seed: int) -> None:
    """A prefill of PROMPT tokens (every row), then STEPS decode passes of one token each, all
    within 1e-4 of transformers' logits over the whole sequence."""
    toks = random_tokens(PROMPT + STEPS, 256, seed=seed)
    ours = [drv.logits(forward([request(toks[:PROMPT], 0, PAGES, PAGE_SIZE, all_rows=True)]))]
    for i in range(PROMPT, PROMPT + STEPS):
        ours.append(drv.logits(forward([request(toks[i : i + 1], i, PAGES, PAGE_SIZE)])))
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([toks])).logits[0]
    torch.testing.assert_close(torch.cat(ours), ref, atol=1e-4, rtol=0)


def test_prefill_and_decode_match_transformers(family: tuple[str, Path]) -> None:
    name, path = family
    drv = make_driver(load_dir(path), page_size=PAGE_SIZE, num_pages=len(PAGES))
    _assert_decode_matches_transformers(drv, path, seed=len(name))


def test_prefill_in_chunks_equals_one_pass(family: tuple[str, Path]) -> None:
    _, path = family
    ckpt = load_dir(path)
    toks = random_tokens(PROMPT + STEPS, 256, seed=7)
    single = make_driver(ckpt, page_size=PAGE_SIZE, num_pages=len(PAGES)).logits(
        forward([request(toks, 0, PAGES, PAGE_SIZE, all_rows=True)])
    )
    chunked = chunked_logits(make_driver(ckpt, page_size=PAGE_SIZE, num_pages=len(PAGES)), toks, 5, PAGES)
    torch.testing.assert_close(chunked, single, atol=1e-4, rtol=0)


# What each fast path does with each family: "runs", or the reason it gives for refusing.
FUSED = {
    "qwen3": "q/k norms or a logit soft cap",
    "olmo2": "q/k norms or a logit soft cap",
    "granite": "embedding, residual or logit multipliers",
    "smollm3": "layers without RoPE or partial RoPE",
    "phi3": "layers without RoPE or partial RoPE",
    "gemma2": "gemma blocks",
}
COMPILED = {"smollm3": "layers without RoPE", "gemma2": "an attention logit soft cap"}


def _driver(ckpt: Checkpoint, **options: object) -> TorchDriver:
    drv = TorchDriver(ckpt, DriverOptions(page_size=PAGE_SIZE, num_pages=len(PAGES), **options))  # type: ignore[arg-type]
    drv.handshake(Hello())
    return drv


def test_fast_paths_run_the_family_or_refuse_it(family: tuple[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    name, path = family
    ckpt = load_dir(path)
    with caplog.at_level(logging.INFO, logger="drivers.torch.driver"):
        drv = _driver(ckpt)
    assert drv.fused is None
    assert f"the fused decode step does not take {FUSED[name]}" in caplog.text
    assert compiled.unsupported(ckpt.cfg) == COMPILED.get(name, "")
    if name == "gemma2":  # a capped model attends in torch: the C++ decode attention has no cap
        assert not drv.attention_kernel
    if name == "olmo2":
        with pytest.raises(ConfigRejected, match="whole projection"):
            check_tensor_parallel(ckpt.cfg, 2)
    else:
        check_tensor_parallel(ckpt.cfg, 2)


def test_compiled_graphs_match_transformers(tmp_path: Path) -> None:
    """OLMo 2's norms (none before attention and MLP, q/k over the whole projection) run in the
    compiled graphs (per layer for the prefill, the whole stack for decode) as in transformers:
    ~45 s of compiling, so one family; the others' switches are scalars in the same functions
    (Granite's multipliers), Gemma 3's per-head q/k norms (test_compiled.py) or Llama's block."""
    path = write_tiny_family(tmp_path / "m", "olmo2", **FAMILIES["olmo2"])
    drv = _driver(load_dir(path), compile=True)
    assert drv.compiled is not None
    _assert_decode_matches_transformers(drv, path, seed=3)


class _ThreadRanks:
    """Ranks as threads of one process: `reduce(rank)` sums a tensor over them, in rank order."""

    def __init__(self, num_ranks: int) -> None:
        self.barrier = threading.Barrier(num_ranks)
        self.parts: list[torch.Tensor] = [torch.empty(0)] * num_ranks

    def reduce(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def summed(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()  # every rank has read the parts before any writes the next
            return total

        return summed


def test_tensor_parallel_shards_sum_to_the_whole_model(family: tuple[str, Path]) -> None:
    """Two shards (2 heads, 1 KV head, half the MLP each), their row-parallel outputs summed
    between them, give the whole model's logits; OLMo 2 is refused instead (above)."""
    name, path = family
    if name == "olmo2":
        pytest.skip("tensor parallelism refuses OLMo 2's q/k norms over the whole projection")
    ckpt = load_dir(path)
    toks = torch.tensor(random_tokens(PROMPT, 256, seed=13))
    positions, rows = torch.arange(PROMPT), torch.arange(PROMPT)
    attend = causal_attention(ckpt.cfg.scale)
    whole = build_model(ckpt, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        want = whole(toks, positions, attend, rows)
    ranks = _ThreadRanks(2)

    def run(rank: int) -> torch.Tensor:
        model = build_model(shard_checkpoint(ckpt, rank, 2), torch.device("cpu"), torch.float32)
        model.reduce = ranks.reduce(rank)
        with torch.inference_mode():
            out: torch.Tensor = model(toks, positions, attend, rows)
        return out

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(run, range(2)))
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)
    assert torch.equal(got[0], got[1])


@needs_kernel
def test_phi3_without_windows_decodes_in_the_fused_step(tmp_path: Path) -> None:
    """Phi-3 is Llama's block once its fused projections are split: the fused step takes it."""
    path = write_tiny_family(tmp_path / "m", "phi3")
    drv = _driver(load_dir(path))
    assert drv.fused is not None
    _assert_decode_matches_transformers(drv, path, seed=5)
    assert drv.fused.passes == STEPS


def test_w8a8_tracks_float32(family: tuple[str, Path]) -> None:
    """w8a8 runs every family (smoothed where its norms allow) close to float32."""
    _, path = family
    ckpt = load_dir(path)
    toks = random_tokens(PROMPT, 256, seed=11)
    spec = forward([request(toks, 0, PAGES, PAGE_SIZE, all_rows=True)])
    dense = _driver(ckpt).logits(spec)
    w8a8 = _driver(ckpt, weights="w8a8").logits(spec)
    corr = torch.corrcoef(torch.stack([dense.flatten(), w8a8.flatten()]))[0, 1]
    assert corr > 0.99, corr


@pytest.mark.parametrize(
    ("model_type", "overrides", "match"),
    [
        ("qwen3", dict(attention_bias=True), "attention_bias"),
        ("granite", dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_configs_it_cannot_run_are_refused_by_name(
    tmp_path: Path, model_type: str, overrides: dict[str, object], match: str
) -> None:
    path = write_tiny_family(tmp_path / "m", model_type, **overrides)
    with pytest.raises(ConfigRejected, match=match):
        load_dir(path)


def test_a_rope_kind_it_lacks_is_refused_by_name() -> None:
    raw = dict(model_type="phi3", **TINY_SHAPE)
    raw["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ConfigRejected, match=r"proportional.*not supported yet"):
        hf_config(raw, "m")


def test_an_unknown_family_is_refused_naming_those_it_knows() -> None:
    with pytest.raises(ConfigRejected, match=r"model_type 'gpt2' is not supported .*qwen3.*olmo2"):
        hf_config({"model_type": "gpt2"}, "m")
