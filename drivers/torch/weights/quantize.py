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

import ctypes
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


# int8 weights [out, in] and their float32 scales [out], one per output row.
Int8Rows = tuple[torch.Tensor, torch.Tensor]
# Rows are quantized this many elements at a time: the float temporaries stay ~1 MiB each.
CHUNK_ELEMENTS = 1 << 18


def quantize_rows(
    read: Callable[[int, int], torch.Tensor], num_rows: int, num_cols: int, device: torch.device | None = None
) -> Int8Rows:
    """Symmetric int8 with one float32 scale per row of the [num_rows, num_cols] weight whose rows
    start..stop `read(start, stop)` returns, a chunk of rows at a time. Rows are independent, so
    the result is the same whether read whole or in chunks."""
    q = torch.empty(num_rows, num_cols, dtype=torch.int8, device=device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=device)
    step = max(1, CHUNK_ELEMENTS // max(1, num_cols))
    for start in range(0, num_rows, step):
        stop = min(num_rows, start + step)
        w = read(start, stop).float()
        s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q[start:stop] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        scale[start:stop] = s
    return q, scale


def per_row_int8(w: torch.Tensor) -> Int8Rows:
    """Symmetric int8 of `w` [out, in] with one float32 scale per output row."""
    return quantize_rows(lambda start, stop: w[start:stop], w.shape[0], w.shape[1], w.device)


class Int8Linear(nn.Module):
    weight_int8: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor | Int8Rows, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        """`weight`: float [out, in], or already quantized (`per_row_int8`'s form)."""
        super().__init__()
        q, scale = weight if isinstance(weight, tuple) else per_row_int8(weight)
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
    n_pad, k_pad = _vnni_padded(n, k)
    if (n_pad, k_pad) == (n, k):
        padded = q.contiguous()  # no copy for the usual shapes: loading holds one less at a time
    else:
        padded = torch.zeros(n_pad, k_pad, dtype=torch.int8, device=q.device)
        padded[:n, :k] = q
    panels = padded.view(n_pad // 64, 4, 16, k_pad // 4, 4).permute(0, 3, 1, 2, 4)
    return panels.contiguous().view(n_pad // 64, k_pad * 64)


def _row_sums(q: torch.Tensor) -> torch.Tensor:
    """int32 sums of the rows of int8 `q`, written a chunk of rows at a time into the result (a
    sum to int32 that returns a new tensor held 4x the weight's bytes at its peak)."""
    sums = torch.empty(q.shape[0], dtype=torch.int32, device=q.device)
    step = max(1, CHUNK_ELEMENTS // max(1, q.shape[1]))
    for start in range(0, q.shape[0], step):
        torch.sum(q[start : start + step], dim=1, dtype=torch.int32, out=sums[start : start + step])
    return sums


def _vnni_padded(n: int, k: int) -> tuple[int, int]:
    return -(-n // 64) * 64, -(-k // 4) * 4


class DynamicInt8Linear(nn.Module):
    """y = (round(x / sx) @ Wq^T) * sx * sw, with sx = max|x_row| / 127 per input row.
    `use_kernel`: the C++ kernel (any CPU), whose `weight_int8` is `pack_vnni`'s layout;
    else the torch path, whose `weight_int8` is [out, in]."""

    weight_int8: torch.Tensor
    scale: torch.Tensor
    weight_sum: torch.Tensor
    packed: torch.Tensor | None

    def __init__(self, weight: torch.Tensor | Int8Rows, bias: torch.Tensor | None, use_kernel: bool) -> None:
        """`weight`: float [out, in], or already quantized (`per_row_int8`'s form)."""
        super().__init__()
        q, scale = weight if isinstance(weight, tuple) else per_row_int8(weight)
        self.in_features = q.shape[1]
        self.out_features = q.shape[0]
        # [out, in] for the torch path (`_int_mm` reads its transpose fastest), or VNNI panels.
        self.register_buffer("weight_int8", pack_vnni(q) if use_kernel else q)
        self.register_buffer("scale", scale)
        # The kernel's VNNI instruction needs each output's weight sum (see w8a8_kernel.cpp).
        self.register_buffer("weight_sum", _row_sums(q))
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
    """Set the kernel's linears' `sgemm_from_rows` to `time_matmuls`' choice for their shape
    (outputs, inputs). Returns the choices."""
    chosen = time_matmuls([(lin.out_features, lin.in_features) for lin in linears if lin.use_kernel])
    for lin in linears:
        if lin.use_kernel:
            lin.sgemm_from_rows = chosen[lin.out_features, lin.in_features]
    return chosen


def time_matmuls(shapes: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """For each weight shape (outputs, inputs), time the integer kernel against its float32-matmul
    path at 64 and 256 rows (best of 2, after a warm-up, on packed stand-in weights: the values do
    not change the speed) and choose the first row count where the float path was faster (0: the
    kernel at every row count). Both give the same bits, so only speed depends on the outcome:
    w8a8 prefill is never slower than a float32 matmul of the same shape."""
    chosen = {}
    for n, k in dict.fromkeys(shapes):
        lin = DynamicInt8Linear((torch.zeros(n, k, dtype=torch.int8), torch.ones(n)), None, True)
        lin.use_packed(lin.packed_bytes())
        threshold = 0
        for rows in _TRIAL_ROWS:
            kernel, sgemm = (_best_time(_trial(lin, rows, path)) for path in (0, 1))
            if sgemm < kernel:
                threshold = rows
                break
        chosen[n, k] = threshold
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


# A fused projection's weight is its parts' rows, one after the other (`fusion.py`).
_FUSED_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def quantize_int8(
    model: Transformer,
    kind: str = "int8",
    use_kernel: bool = True,
    pack: bool = True,
    int8_rows: Callable[[str], Int8Rows] | None = None,
) -> Transformer:
    """Replace the model's linear layers (and output head) by int8 ones of `kind`, in place.
    `use_kernel`: w8a8 on the CPU runs the C++ kernel where it builds (tests turn it off).
    `pack`: on the CPU, every int8 weight becomes a view into one buffer, in step order, on huge
    pages where the OS allows it (`weight_arena.py`), each written as it is made.
    `int8_rows`: where the weights of projections left on the meta device come from, already
    quantized, by checkpoint name (`gguf_stream.Int8Stream`): a fused one is its parts' rows."""
    dtype = model.model.embed_tokens.weight.dtype
    if kind == "int8" and dtype not in (torch.bfloat16, torch.float16):
        raise ConfigRejected("int8 weights need --dtype bfloat16 or float16 activations", "weights")
    if kind not in ("int8", "w8a8"):
        raise ConfigRejected(f"weights must be one of {WEIGHT_KINDS}, got {kind!r}", "weights")

    device = model.model.embed_tokens.weight.device
    on_cpu = device.type == "cpu"
    kernel = kind == "w8a8" and use_kernel and on_cpu and cpu_kernels.load()
    targets = _linears(model)
    # Timed before any weight exists: the trials' float32 copy of a weight never adds to the model.
    matmuls = time_matmuls([tuple(weight.shape) for _, _, weight, _ in targets]) if kernel else {}
    slots: list[torch.Tensor | None] = [None] * len(targets)
    if pack and on_cpu:
        slots[:], huge = weight_arena.slots([_packed_numel(weight.shape, kernel) for _, _, weight, _ in targets])
        log.info("int8 weights packed in one buffer (%s pages)", "huge" if huge else "normal")

    def weight_of(name: str, weight: torch.Tensor) -> torch.Tensor | Int8Rows:
        if not weight.is_meta:
            return weight
        if int8_rows is None:
            raise ConfigRejected(f"the checkpoint has no weights for {name}", "model")
        prefix, _, last = name.rpartition(".")
        q = torch.empty(weight.shape, dtype=torch.int8, device=device)
        scale = torch.empty(weight.shape[0], device=device)
        start = 0
        for part in _FUSED_PARTS.get(last, (last,)):  # each part's rows into place, one part at a time
            part_q, part_scale = int8_rows(f"{prefix}.{part}.weight".removeprefix("."))
            q[start : start + len(part_q)], scale[start : start + len(part_q)] = part_q, part_scale
            start += len(part_q)
        if start != len(q):
            raise ConfigRejected(f"the checkpoint's {name} has {start} rows, the model {len(q)}", "model")
        return q, scale

    converted: list[Int8Linear | DynamicInt8Linear] = []
    todo = list(zip(targets, slots, strict=True))[::-1]
    del targets  # each float weight goes with its linear (a fused one is in no checkpoint)
    while todo:
        (parent, name, weight, bias), slot = todo.pop()
        rows = weight_of(name, weight)
        new = Int8Linear(rows, bias, dtype) if kind == "int8" else DynamicInt8Linear(rows, bias, kernel)
        del rows, weight
        if isinstance(new, DynamicInt8Linear) and kernel:
            new.sgemm_from_rows = matmuls[new.out_features, new.in_features]
        if slot is not None:
            _move_into(new, slot)
        _return_freed_memory()
        converted.append(new)
        if parent is model:
            model.output_head = new
        else:
            setattr(parent, name.rpartition(".")[2], new)
    if not model.cfg.tie_embeddings:
        del model.lm_head
    if kernel:
        log.info(
            "w8a8 matmuls (%s): %s",
            cpu_kernels.variants()["w8a8"],
            ", ".join(f"{n}x{k} float32 from {t} rows" if t else f"{n}x{k} kernel" for (n, k), t in matmuls.items()),
        )
    return model


def _linears(model: Transformer) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]]:
    """The linears to quantize in step order, each as (parent, checkpoint name without ".weight",
    weight, bias), then the output head (parent: the model; tied: the embedding's weight)."""
    names = {id(m): n for n, m in model.named_modules()}
    found: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]] = []
    for block in model.model.blocks():
        for parent in (block.self_attn, *mlp_parts(block.mlp)):  # a MoE router stays as it is
            for attr in _STEP_ORDER:
                child = getattr(parent, attr, None)
                if isinstance(child, nn.Linear):
                    found.append((parent, f"{names[id(parent)]}.{attr}", child.weight, child.bias))
    head = "model.embed_tokens" if model.cfg.tie_embeddings else "lm_head"
    found.append((model, head, model.output_weight(), None))
    return found


def _packed_numel(shape: torch.Size, kernel: bool) -> int:
    """The bytes of a linear's int8 weights in the arena: the kernel's panels, scales and sums
    (`packed_bytes`), else the weight."""
    n, k = shape
    if not kernel:
        return n * k
    n_pad, k_pad = _vnni_padded(n, k)
    return n_pad * k_pad + 8 * n


def _move_into(lin: Int8Linear | DynamicInt8Linear, slot: torch.Tensor) -> None:
    """Copy `lin`'s int8 weights into `slot` (its part of the arena) and read them from there."""
    if _on_kernel(lin):
        assert isinstance(lin, DynamicInt8Linear)
        start = 0
        for part in (lin.weight_int8, lin.scale, lin.weight_sum):  # `packed_bytes`, without the copy
            flat = part.reshape(-1).view(torch.int8)
            slot[start : start + flat.numel()].copy_(flat)
            start += flat.numel()
        lin.use_packed(slot)
    else:
        slot_2d = slot.view(lin.weight_int8.shape)
        slot_2d.copy_(lin.weight_int8)
        lin.weight_int8 = slot_2d


# glibc's malloc_trim, where the C library has it.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)


def _return_freed_memory() -> None:
    """Give the C heap's free pages back to the OS. glibc serves temporaries of up to 32 MiB (a
    chunk of rows, one projection's int8) from its heap, where the small tensors kept between
    them pin what they free: without this, quantizing a model held ~1x its size again in RSS."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
