"""The mixture-of-experts feed-forward of Mixtral and Qwen3-MoE: a router picks each token's top-k
experts (SiLU MLPs) and the block returns the routing-weighted sum of their outputs. It takes the
same input as `model.MLP`; it knows nothing of attention, pages, LoRA or checkpoint formats."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drivers.torch.config import ModelConfig


class Expert(nn.Module):
    """One expert: `model.MLP`'s SiLU block in its own size (gate and up fused by `fusion.py`)."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class MoE(nn.Module):
    """`gate` is the router (kept in the activation dtype by every weight transform: a quantized
    router would move tokens between experts); `experts` hold the projections."""

    gate: nn.Linear

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.top_k = cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts [T, k] and their float32 weights [T, k], as transformers computes
        them: softmax over the router's logits in float32, the top k, renormalized to sum 1 where
        `norm_topk_prob` (Mixtral always; Qwen3-MoE as its config says). A row's choice depends on
        its own logits only, never on the other rows of the pass."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. The pass's (token, expert) pairs are sorted by expert and
        each expert with tokens runs once over all of its rows; outputs are added up in expert
        order, as transformers adds them. Reading the counts back costs one host sync a layer."""
        chosen, weights = self.route(x)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        pair_weights = weights.flatten()
        out = torch.zeros_like(x)
        for expert, pairs in zip(self.experts, order.split(counts), strict=True):
            if pairs.numel() == 0:
                continue
            rows = pairs // self.top_k
            y = expert(x[rows]) * pair_weights[pairs, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out


def mlp_parts(mlp: nn.Module) -> list[nn.Module]:
    """The modules holding a block's MLP projections (gate, up, down): the MLP itself, or each
    expert of a mixture-of-experts block. Weight transforms walk these."""
    return list(mlp.experts) if isinstance(mlp, MoE) else [mlp]
