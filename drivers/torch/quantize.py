"""Weight-only int8 quantization, a transform applied after the model is built (gpt-fast style):
every projection and the output head keep int8 weights with one scale per output row and run
through torch's int8 weight-only matmul. Batch-1 decode reads weight bytes, so 4x fewer bytes than
fp32 (2x fewer than bf16) is the main lever on the CPU. Activations must be bf16/fp16: torch's
fp32 int8 kernel is slower than a dense fp32 matmul."""

from __future__ import annotations

import torch
from torch import nn

from drivers.errors import ConfigRejected
from drivers.torch.model import Transformer


class Int8Linear(nn.Module):
    weight_int8: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).contiguous(), self.weight_int8, self.scale)
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


def quantize_int8(model: Transformer) -> Transformer:
    """Replace the model's linear layers (and output head) by `Int8Linear`, in place."""
    dtype = model.model.embed_tokens.weight.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ConfigRejected("int8 weights need --dtype bfloat16 or float16 activations", "weights")
    for block in model.model.blocks():
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child.weight, child.bias, dtype))
    model.output_head = Int8Linear(model.output_weight(), None, dtype)
    if not model.cfg.tie_embeddings:
        del model.lm_head
    return model
