"""A load-time transform for float32 on the CPU: keep every projection's weight transposed
([in, out], contiguous) and multiply with `x @ w`. Measured on the 2-core dev machine at 8-32 rows,
this takes the GEMM path that is about 2x faster than `F.linear`'s (same at 1 row); bf16 shows no
such gap, so the transform is applied to float32 only. With the C++ kernels built, decode rows (up
to `wafer::f32_linear_max_rows()`: 24, 4 in the portable variant) go through `wafer::f32_linear_t`
(`f32_matvec.cpp`), which streams these weights 1.2-2x faster than torch's product at one row and
1.2-3.6x at 2-24 (bench/f32_matmul.py); more rows (prefill) keep `x @ w`."""

from __future__ import annotations

import torch
from torch import nn

from drivers.torch.model import Transformer
from drivers.torch.moe import mlp_parts


class TransposedLinear(nn.Module):
    weight_t: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool = False) -> None:
        super().__init__()
        self.register_buffer("weight_t", weight.detach().T.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.use_kernel = use_kernel
        # Rows up to which the op runs in the variant chosen at load (it hands more to torch).
        self.kernel_rows = int(torch.ops.wafer.f32_linear_max_rows()) if use_kernel else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Eager only, checked first: the compiled graphs keep `x @ w` (a test of the row count
        # there would guard their dynamic row dimension and split them).
        if self.use_kernel and not torch.compiler.is_compiling() and x.dim() == 2 and x.shape[0] <= self.kernel_rows:
            y: torch.Tensor = torch.ops.wafer.f32_linear_t(x, self.weight_t)
        else:
            y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def transpose_linears(model: Transformer, use_kernel: bool = False) -> Transformer:
    """Replace the model's linear layers (and output head) by `TransposedLinear`, in place;
    `use_kernel`: decode rows through the C++ op (the caller has loaded the kernels)."""
    for block in model.model.blocks():
        for parent in (block.self_attn, *mlp_parts(block.mlp)):  # a MoE router stays as it is
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, TransposedLinear(child.weight, child.bias, use_kernel))
    model.output_head = TransposedLinear(model.output_weight(), None, use_kernel)
    if not model.cfg.tie_embeddings:
        del model.lm_head
    return model
