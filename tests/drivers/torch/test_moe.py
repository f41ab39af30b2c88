"""The mixture-of-experts families (Mixtral, Qwen3-MoE) on tiny random checkpoints that
transformers itself builds and saves: logits within 1e-4 of transformers' forward over a prefill
and 16 decode steps, a prefill in chunks equal to one pass, a batch equal to each sequence alone,
transformers 5's fused expert tensors loaded as the per-expert ones, w8a8 experts, tensor-parallel
shards equal to the whole model, and the fast paths that refuse MoE blocks saying so. The router
weights are scaled up so that routing differs from token to token (checked)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bridge_schema.batch import RequestSpec
from bridge_schema.messages import Adapter
from drivers.errors import ConfigRejected, Unsupported
from drivers.torch.config import ModelConfig
from drivers.torch.driver import build_model
from drivers.torch.moe import MoE
from drivers.torch.parallel.tensor_parallel import shard_checkpoint
from drivers.torch.runners import compiled
from drivers.torch.runners.cuda_graphs import DecodeGraphs
from drivers.torch.weights.quantize import DynamicInt8Linear, Int8Linear
from tests.drivers.torch import test_families
from tests.drivers.torch.helpers import (
    forward,
    hf_model,
    load_dir,
    make_driver,
    random_tokens,
    request,
    write_tiny_family,
)
from tests.drivers.torch.test_families import PAGE_SIZE, PAGES, PROMPT, _driver

# Per family: 4 experts, top 2. Mixtral windows every layer and always renormalizes the top-k
# weights; Qwen3-MoE renormalizes as `norm_topk_prob` says, and keeps a dense MLP in the layers of
# `mlp_only_layers` and those off `decoder_sparse_step` (here layer 1 both ways).
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, sliding_window=8)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=3, mlp_only_layers=[1]),
    ),
    "qwen3_moe_norm": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
}
DENSE_LAYERS = {"mixtral": (), "qwen3_moe": (1,), "qwen3_moe_norm": (0, 2)}
ROUTER_SCALE = 4.0  # router logits of a few units: tokens pick different experts


def _write(path: Path, name: str) -> Path:
    """The family's tiny checkpoint, saved by transformers, with its routers' weights scaled."""
    model_type, overrides = FAMILIES[name]
    write_tiny_family(path, model_type, **overrides)
    model = hf_model(path)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, _write(tmp_path_factory.mktemp(name) / "m", name)


def test_the_checkpoint_routes_tokens_to_every_expert(family: tuple[str, Path]) -> None:
    """The config's MoE layers are MoE blocks, and the tokens of a prompt spread over all experts
    (so that the tests below see routing that differs between tokens)."""
    name, path = family
    ckpt = load_dir(path)
    assert ckpt.cfg.dense_mlp_layers == DENSE_LAYERS[name]
    model = build_model(ckpt, torch.device("cpu"), torch.float32)
    blocks = model.model.blocks()
    assert [isinstance(b.mlp, MoE) for b in blocks] == [i not in DENSE_LAYERS[name] for i in range(len(blocks))]
    moe = next(b.mlp for b in blocks if isinstance(b.mlp, MoE))
    x = model.model.embed_tokens(torch.tensor(random_tokens(PROMPT, 256, seed=1)))
    with torch.no_grad():
        chosen, weights = moe.route(x)
    assert set(chosen.flatten().tolist()) == {0, 1, 2, 3}
    assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 2
    sums = weights.sum(dim=-1)
    if ckpt.cfg.norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert bool((sums < 0.999).all())


def test_prefill_and_decode_match_transformers(family: tuple[str, Path]) -> None:
    """A prefill of 17 tokens and 16 decode steps within 1e-4 of transformers (as the dense
    families)."""
    test_families.test_prefill_and_decode_match_transformers(family)


def test_prefill_in_chunks_equals_one_pass(family: tuple[str, Path]) -> None:
    test_families.test_prefill_in_chunks_equals_one_pass(family)


def test_a_batch_equals_each_sequence_alone(family: tuple[str, Path]) -> None:
    """Three contexts prefilled in one pass, then decoded in one pass, give the logits each gets
    alone: a token's experts and output never depend on the other rows of its pass."""
    _, path = family
    ckpt = load_dir(path)
    lengths = (17, 6, 11)
    seqs = [random_tokens(n + 1, 256, seed=20 + i) for i, n in enumerate(lengths)]
    pages = [PAGES[8 * i : 8 * i + 8] for i in range(len(seqs))]

    def prefill(i: int) -> RequestSpec:
        return request(seqs[i][:-1], 0, pages[i], PAGE_SIZE, all_rows=True, context_id=i)

    def decode(i: int) -> RequestSpec:
        return request(seqs[i][-1:], lengths[i], pages[i], PAGE_SIZE, context_id=i)

    batched = make_driver(ckpt, page_size=PAGE_SIZE, num_pages=len(PAGES))
    both = [
        batched.logits(forward([prefill(i) for i in range(3)])),
        batched.logits(forward([decode(i) for i in range(3)])),
    ]
    alone_prefill, alone_decode = [], []
    for i in range(3):
        drv = make_driver(ckpt, page_size=PAGE_SIZE, num_pages=len(PAGES))
        alone_prefill.append(drv.logits(forward([prefill(i)])))
        alone_decode.append(drv.logits(forward([decode(i)])))
    torch.testing.assert_close(both[0], torch.cat(alone_prefill), atol=1e-4, rtol=0)
    torch.testing.assert_close(both[1], torch.cat(alone_decode), atol=1e-4, rtol=0)


def test_fused_expert_tensors_load_as_per_expert_ones(family: tuple[str, Path], tmp_path: Path) -> None:
    """transformers 5 keeps each layer's experts as two 3-D tensors (gate_up_proj, down_proj)
    under `mlp.experts`; a checkpoint written that way loads to the same weights."""
    _, path = family
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((path / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf_model(path).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    want, got = load_dir(path).state, load_dir(fused).state
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_fast_paths_refuse_moe_blocks_saying_so(family: tuple[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """The fused C++ decode step, the compiled graphs and the CUDA graphs do not take MoE blocks
    (they read each expert's token count back to the host): each says so and the driver keeps
    the model's own path, which the test above checked against transformers."""
    _, path = family
    ckpt = load_dir(path)
    with caplog.at_level(logging.INFO):
        drv = _driver(ckpt)
        assert drv.cache is not None
        graphs = DecodeGraphs(ckpt.cfg, drv.model, drv.cache, 64, 4, capture=False)
    assert drv.fused is None
    assert "the fused decode step does not take mixture-of-experts blocks" in caplog.text
    assert compiled.unsupported(ckpt.cfg) == "mixture-of-experts blocks"
    assert "CUDA graphs off: the decode graphs do not take mixture-of-experts blocks" in caplog.text
    assert graphs.run(drv.plan_pass(forward([request([5], 0, PAGES, PAGE_SIZE)]))[0], torch.tensor([0])) is None


def test_w8a8_quantizes_the_experts_and_tracks_float32(
    family: tuple[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """w8a8 makes every expert's projections int8 (the router stays float: a rounded router would
    move tokens between experts), without smoothing (its factors need one gate/up per norm)."""
    _, path = family
    ckpt = load_dir(path)
    toks = random_tokens(PROMPT, 256, seed=11)
    spec = forward([request(toks, 0, PAGES, PAGE_SIZE, all_rows=True)])
    dense = _driver(ckpt).logits(spec)
    with caplog.at_level(logging.INFO, logger="drivers.torch.driver"):
        drv = _driver(ckpt, weights="w8a8")
    assert "w8a8 weights are not smoothed (smoothing does not take mixture-of-experts blocks)" in caplog.text
    moes = [b.mlp for b in drv.model.model.blocks() if isinstance(b.mlp, MoE)]
    assert moes and all(type(m.gate) is nn.Linear for m in moes)
    projections = [lin for m in moes for e in m.experts for lin in (e.gate_up, e.down_proj)]
    assert all(isinstance(lin, DynamicInt8Linear) for lin in projections)
    w8a8 = drv.logits(spec)
    corr = torch.corrcoef(torch.stack([dense.flatten(), w8a8.flatten()]))[0, 1]
    assert corr > 0.99, corr


def test_int8_weights_quantize_the_experts_in_bfloat16(family: tuple[str, Path]) -> None:
    """Weight-only int8 (bf16 activations) quantizes the experts too, close to dense bf16."""
    _, path = family
    ckpt = load_dir(path)
    spec = forward([request(random_tokens(PROMPT, 256, seed=12), 0, PAGES, PAGE_SIZE, all_rows=True)])
    dense = _driver(ckpt, dtype="bfloat16").logits(spec)
    drv = _driver(ckpt, dtype="bfloat16", weights="int8")
    experts = [e for b in drv.model.model.blocks() if isinstance(b.mlp, MoE) for e in b.mlp.experts]
    assert experts and all(isinstance(e.gate_up, Int8Linear) for e in experts)
    int8 = drv.logits(spec)
    corr = torch.corrcoef(torch.stack([dense.flatten().float(), int8.flatten().float()]))[0, 1]
    assert corr > 0.99, corr


def test_tensor_parallel_shards_sum_to_the_whole_model(family: tuple[str, Path]) -> None:
    """Two shards, each with half of every expert's columns (the router whole on both, so both
    route alike), their row-parallel outputs summed between them, give the whole model's logits:
    the dense families' check, on these."""
    _, path = family
    ckpt = load_dir(path)
    shard = shard_checkpoint(ckpt, 1, 2)
    assert shard.cfg.moe_intermediate_size == ckpt.cfg.moe_intermediate_size // 2
    routers = [key for key in ckpt.state if key.endswith(".mlp.gate.weight")]
    assert routers and all(shard.state[key].shape == ckpt.state[key].shape for key in routers)
    test_families.test_tensor_parallel_shards_sum_to_the_whole_model(family)


def test_lora_on_an_experts_mlp_is_refused(tmp_path: Path) -> None:
    """An adapter's MLP deltas fit no expert: the pass is refused, not run without them."""
    path = _write(tmp_path / "m", "mixtral")
    drv = make_driver(load_dir(path), page_size=PAGE_SIZE, num_pages=len(PAGES))
    adapter = tmp_path / "a"
    adapter.mkdir()
    prefix = "base_model.model.model.layers.0.mlp.down_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.randn(4, 128), f"{prefix}.lora_B.weight": torch.randn(64, 4)},
        str(adapter / "adapter_model.safetensors"),
    )
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    drv.adapter(Adapter(op="load", adapter_id=1, path=str(adapter)))
    with pytest.raises(Unsupported, match="mixture-of-experts"):
        drv.logits(forward([request([5, 6, 7], 0, PAGES, PAGE_SIZE, adapter_id=1)]))


@pytest.mark.parametrize(
    ("model_type", "overrides", "match"),
    [
        ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, hidden_act="gelu"), "hidden_act"),
        ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, attention_bias=True), "attention_bias"),
    ],
)
def test_configs_it_cannot_run_are_refused_by_name(
    tmp_path: Path, model_type: str, overrides: dict[str, object], match: str
) -> None:
    path = write_tiny_family(tmp_path / "m", model_type, num_hidden_layers=1, **overrides)
    with pytest.raises(ConfigRejected, match=match):
        load_dir(path)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(num_experts=4, experts_per_token=5, moe_intermediate_size=8), "experts_per_token"),
        (dict(num_experts=4, experts_per_token=2), "moe_intermediate_size"),
        (dict(num_experts=4, experts_per_token=2, moe_intermediate_size=8, dense_mlp_layers=(2,)), "dense MLP layer"),
        (dict(experts_per_token=2), "need num_experts"),
    ],
)
def test_model_config_checks_its_expert_fields(fields: dict[str, object], match: str) -> None:
    shape = dict(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4
    )
    with pytest.raises(ConfigRejected, match=match):
        ModelConfig(arch="llama", **shape, **fields)  # type: ignore[arg-type]
