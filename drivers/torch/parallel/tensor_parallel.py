"""Megatron-style sharding of a loaded checkpoint and of LoRA adapters for one rank of N: q/k/v
and gate/up are column parallel (rank r keeps its heads, its MLP columns, each expert's columns),
o and down are row parallel (their partial outputs are summed over ranks by the model's `reduce`);
embeddings, norms, MoE routers (every rank routes alike) and the output head are replicated.
Pure tensor slicing: knows nothing of processes."""

from __future__ import annotations

import dataclasses
import re

import torch

from drivers.errors import ConfigRejected, RequestRejected
from drivers.torch.config import ModelConfig
from drivers.torch.weights.checkpoint import Checkpoint
from drivers.torch.weights.lora import LoraWeights

_LAYER_KEY = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp|mlp\.experts\.\d+)\.(\w+_proj)\.(weight|bias)$")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # outputs split over ranks
ROW_PARALLEL = ("o_proj", "down_proj")  # inputs split over ranks; outputs summed


def check_tensor_parallel(cfg: ModelConfig, num_ranks: int) -> None:
    """Raise `ConfigRejected` naming the numbers unless `cfg` splits evenly over `num_ranks`."""
    if num_ranks < 1:
        raise ConfigRejected(f"must be 1 or more, got {num_ranks}", "tensor_parallel")
    if num_ranks > 1 and cfg.qk_norm == "projection":
        # Each rank holds some heads, and the norm's mean square runs over all of them.
        raise ConfigRejected(
            "tensor parallelism does not shard q/k norms over the whole projection (OLMo 2): run one rank",
            "tensor_parallel",
        )
    for what, n in (
        ("KV heads", cfg.num_kv_heads),
        ("attention heads", cfg.num_heads),
        ("MLP columns (intermediate size)", cfg.intermediate_size),
        ("expert columns (moe_intermediate_size)", cfg.moe_intermediate_size),
    ):
        if n % num_ranks:
            raise ConfigRejected(
                f"{num_ranks} ranks do not divide the model's {n} {what} ({cfg.num_heads} heads, "
                f"{cfg.num_kv_heads} KV heads): choose a divisor of {cfg.num_kv_heads}",
                "tensor_parallel",
            )


def shard_config(cfg: ModelConfig, num_ranks: int) -> ModelConfig:
    """The shape one rank's model has: 1/N of the heads, KV heads, MLP and expert columns."""
    check_tensor_parallel(cfg, num_ranks)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // num_ranks,
        num_kv_heads=cfg.num_kv_heads // num_ranks,
        intermediate_size=cfg.intermediate_size // num_ranks,
        moe_intermediate_size=cfg.moe_intermediate_size // num_ranks,
    )


def _rows(cfg: ModelConfig, proj: str, is_expert: bool) -> int:
    """Output rows of a column-parallel projection on the full model."""
    if is_expert:
        return cfg.moe_intermediate_size
    if proj == "q_proj":
        return cfg.num_heads * cfg.head_dim
    if proj in ("k_proj", "v_proj"):
        return cfg.num_kv_heads * cfg.head_dim
    return cfg.intermediate_size


def _part(t: torch.Tensor, dim: int, rank: int, num_ranks: int) -> torch.Tensor:
    size = t.shape[dim] // num_ranks
    # A copy, so the full tensor is freed once the checkpoint is dropped.
    return t.narrow(dim, rank * size, size).clone()


def shard_checkpoint(ckpt: Checkpoint, rank: int, num_ranks: int) -> Checkpoint:
    """Rank `rank`'s share of `ckpt`, loadable as an ordinary (smaller) model. Contiguous blocks of
    heads keep grouped-query attention intact: with N dividing the KV heads, rank r's query heads
    are exactly those that read rank r's KV heads."""
    cfg = ckpt.cfg
    state: dict[str, torch.Tensor] = {}
    for key, t in ckpt.state.items():
        m = _LAYER_KEY.match(key)
        proj = m.group(2) if m else ""
        if proj in COLUMN_PARALLEL:
            assert m is not None and t.shape[0] == _rows(cfg, proj, ".experts." in m.group(1)), key
            state[key] = _part(t, 0, rank, num_ranks)
        elif proj in ROW_PARALLEL and m is not None and m.group(3) == "weight":
            state[key] = _part(t, 1, rank, num_ranks)
        else:  # embeddings, norms, the output head (o and down have no bias in this model)
            state[key] = t
    return dataclasses.replace(ckpt, cfg=shard_config(cfg, num_ranks), state=state)


def shard_lora(weights: LoraWeights, rank: int, num_ranks: int) -> LoraWeights:
    """An adapter's share consistent with its base projections: a column-parallel delta B @ A
    keeps B's rows of this rank (A whole); a row-parallel one keeps A's columns (B whole), so its
    partial delta is summed over ranks with the base projection's partial output."""
    pairs = {}
    for (layer, proj), (a, b) in weights.pairs.items():
        if proj in COLUMN_PARALLEL:
            pairs[(layer, proj)] = (a, _part(b, 0, rank, num_ranks))
        elif proj in ROW_PARALLEL:
            pairs[(layer, proj)] = (_part(a, 1, rank, num_ranks), b)
        else:
            raise RequestRejected(f"LoRA on {proj} is not sharded under tensor parallelism", "path")
    return LoraWeights(weights.scale, pairs)
