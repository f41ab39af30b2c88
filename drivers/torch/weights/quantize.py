"""Int8 weights, a transform applied after the model is built (gpt-fast style): every projection
and the output head keep int8 weights with one scale per output row. Batch-1 decode reads weight
bytes, so 4x fewer bytes than fp32 is the main lever on the CPU. Two kinds:

- "int8": weight-only, through torch's int8 weight-only matmul; activations must be bf16/fp16
  (its fp32 kernel is slower than a dense fp32 matmul).
- "w8a8": each input row is also quantized to int8 (its own scale, so a row's result never depends
  on the other rows of the batch) and multiplied with the exact integer matmul `torch._int_mm`;
  any activation dtype. Measured on the 2-core dev machine (1 thread, SmolLM2's shapes), it is
  1.6x faster than the weight-only kernel at 1 row and 2.3x at 8, at the cost of a larger error.
  On the CPU its matmuls run the C++ kernel of `cpu_kernels.py` where it builds, in the variant
  for the CPU's instruction set (bit-identical results; its weights are packed in panels,
  `pack_vnni`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from drivers.errors import ConfigRejected
from drivers.torch.kernels import cpu_kernels
from drivers.torch.model import Transformer
from drivers.torch.moe import mlp_parts
from drivers.torch.weights import weight_arena

log = logging.getLogger(__name__)
WEIGHT_KINDS = ("dense", "int8", "w8a8")


def _per_row_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of `w` [out, in] with one float32 scale per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    weight_int8: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        q, scale = _per_row_int8(weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).contiguous(), self.weight_int8, self.scale)
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


def pack_vnni(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [out, in] in the C++ kernel's layout (see w8a8_kernel.cpp): panels of 64
    outputs, [ceil(out / 64), ceil(in / 4) * 256], panel[p][k / 4][b][c][k % 4] = q[64 p + 16 b +
    c][k], zero past the weight's rows and columns."""
    n, k = q.shape
    n_pad, k_pad = -(-n // 64) * 64, -(-k // 4) * 4
    padded = torch.zeros(n_pad, k_pad, dtype=torch.int8, device=q.device)
    padded[:n, :k] = q
    panels = padded.view(n_pad // 64, 4, 16, k_pad // 4, 4).permute(0, 3, 1, 2, 4)
    return panels.contiguous().view(n_pad // 64, k_pad * 64)


class DynamicInt8Linear(nn.Module):
    """y = (round(x / sx) @ Wq^T) * sx * sw, with sx = max|x_row| / 127 per input row.
    `use_kernel`: the C++ kernel (any CPU), whose `weight_int8` is `pack_vnni`'s layout;
    else the torch path, whose `weight_int8` is [out, in]."""

    weight_int8: torch.Tensor
    scale: torch.Tensor
    weight_sum: torch.Tensor
    packed: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, use_kernel: bool) -> None:
        super().__init__()
        q, scale = _per_row_int8(weight)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        # [out, in] for the torch path (`_int_mm` reads its transpose fastest), or VNNI panels.
        self.register_buffer("weight_int8", pack_vnni(q) if use_kernel else q)
        self.register_buffer("scale", scale)
        # The kernel's VNNI instruction needs each output's weight sum (see w8a8_kernel.cpp).
        self.register_buffer("weight_sum", q.sum(dim=1, dtype=torch.int32))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.use_kernel = use_kernel
        # The kernel: from this many rows on, run torch's float32 matmul on the same integers
        # (bit-identical; 0 = never). Set by `choose_matmuls` from measured speed.
        self.sgemm_from_rows = 0
        # The kernel's weights as one tensor (`use_packed`), once `quantize_int8` has packed them.
        self.register_buffer("packed", None, persistent=False)

    def packed_bytes(self) -> torch.Tensor:
        """The kernel's weights as one int8 tensor: the panels, then the float32 scales, then the
        int32 weight sums (what `torch.ops.wafer.w8a8_linear_packed` reads)."""
        parts = (self.weight_int8.reshape(-1), self.scale.view(torch.int8), self.weight_sum.view(torch.int8))
        return torch.cat(parts)

    def use_packed(self, packed: torch.Tensor) -> None:
        """Read the weights from `packed` (`packed_bytes`' layout, e.g. in the weight arena) from
        now on; `weight_int8`, `scale` and `weight_sum` become views into it."""
        shape, n = self.weight_int8.shape, self.scale.numel()
        size = self.weight_int8.numel()
        assert packed.dtype == torch.int8 and packed.numel() == size + 8 * n, "not packed_bytes' layout"
        self.weight_int8 = packed[:size].view(shape)
        self.scale = packed[size : size + 4 * n].view(torch.float32)
        self.weight_sum = packed[size + 4 * n :].view(torch.int32)
        self.packed = packed

    def kernel(self, rows: torch.Tensor, sgemm_from_rows: int) -> torch.Tensor:
        """The C++ kernel on float32 `rows` [M, in]: one tensor of weights once packed (the compiled
        graphs then pass one handle, not three), else the three."""
        if self.packed is not None:
            return torch.ops.wafer.w8a8_linear_packed(rows, self.packed, self.out_features, sgemm_from_rows)
        return torch.ops.wafer.w8a8_linear(rows, self.weight_int8, self.scale, self.weight_sum, sgemm_from_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        if self.use_kernel:
            y = self.kernel(rows, self.sgemm_from_rows)
        else:
            y = w8a8_reference(rows, self.weight_int8, self.scale)
        y = y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(x.dtype)


def w8a8_reference(rows: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch path of `DynamicInt8Linear` on float32 `rows` [M, in]: float32 [M, out]."""
    sx = (rows.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    xq = torch.round(rows / sx).clamp(-127, 127).to(torch.int8)
    return torch._int_mm(xq, weight_int8.T) * (sx * scale)


# Row counts at which `choose_matmuls` times the kernel against the float32 matmul.
_TRIAL_ROWS = (64, 256)


def choose_matmuls(linears: list[DynamicInt8Linear]) -> dict[tuple[int, int], int]:
    """For each weight shape (outputs, inputs) among the kernel's linears, time the integer kernel
    against its float32-matmul path at 64 and 256 rows (best of 2, after a warm-up) and set the
    layers' `sgemm_from_rows` to the first row count where the float path was faster (0: the
    kernel at every row count). Both give the same bits, so only speed depends on the outcome:
    w8a8 prefill is never slower than a float32 matmul of the same shape. Returns the choices."""
    by_shape: dict[tuple[int, int], list[DynamicInt8Linear]] = {}
    for lin in linears:
        if lin.use_kernel:
            by_shape.setdefault((lin.scale.numel(), lin.in_features), []).append(lin)
    chosen = {}
    for shape, group in by_shape.items():
        threshold = 0
        for rows in _TRIAL_ROWS:
            kernel, sgemm = (_best_time(_trial(group[0], rows, path)) for path in (0, 1))
            if sgemm < kernel:
                threshold = rows
                break
        for lin in group:
            lin.sgemm_from_rows = threshold
        chosen[shape] = threshold
    return chosen


def _trial(lin: DynamicInt8Linear, rows: int, sgemm_from_rows: int) -> Callable[[], object]:
    x = torch.randn(rows, lin.in_features)
    return lambda: lin.kernel(x, sgemm_from_rows)


def _best_time(fn: Callable[[], object], repeats: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _on_kernel(lin: nn.Module) -> bool:
    return isinstance(lin, DynamicInt8Linear) and lin.use_kernel


# The projections of a block in the order a step runs them (fused or not).
_STEP_ORDER = ("qkv", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up", "gate_proj", "up_proj", "down_proj")


def quantize_int8(model: Transformer, kind: str = "int8", use_kernel: bool = True, pack: bool = True) -> Transformer:
    """Replace the model's linear layers (and output head) by int8 ones of `kind`, in place.
    `use_kernel`: w8a8 on the CPU runs the C++ kernel where it builds (tests turn it off).
    `pack`: on the CPU, every int8 weight becomes a view into one buffer, in step order, on huge
    pages where the OS allows it (`weight_arena.py`)."""
    dtype = model.model.embed_tokens.weight.dtype
    if kind == "int8" and dtype not in (torch.bfloat16, torch.float16):
        raise ConfigRejected("int8 weights need --dtype bfloat16 or float16 activations", "weights")
    if kind not in ("int8", "w8a8"):
        raise ConfigRejected(f"weights must be one of {WEIGHT_KINDS}, got {kind!r}", "weights")

    on_cpu = model.model.embed_tokens.weight.device.type == "cpu"
    kernel = kind == "w8a8" and use_kernel and on_cpu and cpu_kernels.load()

    def convert(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear | DynamicInt8Linear:
        return Int8Linear(weight, bias, dtype) if kind == "int8" else DynamicInt8Linear(weight, bias, kernel)

    converted = []
    for block in model.model.blocks():
        for parent in (block.self_attn, *mlp_parts(block.mlp)):  # a MoE router stays as it is
            for name in _STEP_ORDER:
                child = getattr(parent, name, None)
                if isinstance(child, nn.Linear):
                    converted.append(convert(child.weight, child.bias))
                    setattr(parent, name, converted[-1])
    head = convert(model.output_weight(), None)
    model.output_head = head
    converted.append(head)
    if not model.cfg.tie_embeddings:
        del model.lm_head
    if pack and on_cpu:
        # The kernel's linears: their weights, scales and sums, one tensor each; the others: their weights.
        packed = [lin.packed_bytes() if _on_kernel(lin) else lin.weight_int8 for lin in converted]
        views, huge = weight_arena.pack(packed)
        for lin, view in zip(converted, views, strict=True):
            if _on_kernel(lin):
                assert isinstance(lin, DynamicInt8Linear)
                lin.use_packed(view)
            else:
                lin.weight_int8 = view
        log.info("int8 weights packed in one buffer (%s pages)", "huge" if huge else "normal")
    if kernel:
        kernels = [lin for lin in converted if isinstance(lin, DynamicInt8Linear)]
        choices = choose_matmuls(kernels)
        log.info(
            "w8a8 matmuls (%s): %s",
            cpu_kernels.variants()["w8a8"],
            ", ".join(f"{n}x{k} float32 from {t} rows" if t else f"{n}x{k} kernel" for (n, k), t in choices.items()),
        )
    return model
