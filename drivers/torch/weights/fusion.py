"""A transform applied after the weights are loaded: q/k/v and gate/up projections become one
matmul each (3 + 2 weight reads become 2 launches per layer), which matters when a decode step is
~200 small ops. LoRA still sees the projections by their own names (the model splits the output)."""

from __future__ import annotations

import torch
from torch import nn

from drivers.torch.model import Transformer
from drivers.torch.moe import mlp_parts


def _cat_linear(parts: list[nn.Module]) -> nn.Linear:
    linears = [p for p in parts if isinstance(p, nn.Linear)]
    assert len(linears) == len(parts), "fuse before quantizing"
    weight = torch.cat([p.weight.detach() for p in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        biases = [p.bias.detach() for p in linears if p.bias is not None]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return fused


def fuse_projections(model: Transformer) -> Transformer:
    """Fuse in place; the separate projections are dropped (their weights live in the fused ones)."""
    for block in model.model.blocks():
        attn = block.self_attn
        attn.qkv = _cat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj
        for mlp in mlp_parts(block.mlp):  # the MLP, or each expert
            mlp.gate_up = _cat_linear([mlp.gate_proj, mlp.up_proj])
            del mlp.gate_proj, mlp.up_proj
    return model
