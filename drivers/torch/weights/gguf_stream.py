"""GGUF tensors read from the file a few rows at a time, so a quantized file loads as int8 without
a float32 copy of the whole model: bytes come through `pread` (not the reader's memory map, whose
pages would count in the process's resident set), are dequantized with `gguf` one chunk of rows at
a time and, for projections, quantized per output row at once (`quantize.quantize_rows`). Knows
GGUF's tensor layout; the model's names and row order come from `gguf_loader.py`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from drivers.errors import ConfigRejected
from drivers.torch.progress import Progress
from drivers.torch.weights.quantize import CHUNK_ELEMENTS, Int8Rows, quantize_rows

# A tensor's rows in the model's order (e.g. llama.cpp's RoPE rows un-permuted); rows are int8
# (with their scales as a [rows, 1] tensor) or float.
RowOrder = Callable[[torch.Tensor], torch.Tensor]


def _dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    return qtype in floats or qtype in gguf.quants._type_traits


@dataclass(frozen=True, slots=True)
class TensorSpan:
    """Where a GGUF tensor's bytes lie: its type, its shape (numpy order: rows first) and the
    file offset of its data. Row r of the [rows, columns] view starts at `offset + r * row_bytes`."""

    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: gguf.ReaderTensor) -> TensorSpan:
        if not _dequantizable(tensor.tensor_type):
            raise ConfigRejected(
                f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, not dequantizable", "model"
            )
        return cls(tensor.tensor_type, tuple(int(d) for d in reversed(tensor.shape.tolist())), tensor.data_offset)

    @property
    def num_cols(self) -> int:
        return self.shape[-1]

    @property
    def num_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.num_cols // block * size

    def rows(self, start: int, stop: int) -> TensorSpan:
        """Rows start..stop of this matrix."""
        assert len(self.shape) == 2 and 0 <= start <= stop <= self.num_rows
        return TensorSpan(self.qtype, (stop - start, self.num_cols), self.offset + start * self.row_bytes)


def read_rows(fd: int, span: TensorSpan, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop of the tensor at `span` in the open file `fd`, dequantized: float32
    [stop - start, columns]. The same values as `gguf.quants.dequantize` of the whole tensor."""
    buf = bytearray((stop - start) * span.row_bytes)
    if os.preadv(fd, [buf], span.offset + start * span.row_bytes) != len(buf):
        raise ConfigRejected(f"GGUF file is truncated (a tensor at byte {span.offset} is cut short)", "model")
    raw = np.frombuffer(buf, dtype=np.uint8).reshape(stop - start, span.row_bytes)
    rows = gguf.quants.dequantize(raw, span.qtype)
    return torch.from_numpy(rows.reshape(stop - start, span.num_cols))


def _step(num_cols: int) -> int:
    return max(1, CHUNK_ELEMENTS // num_cols)


def read_tensor(path: Path, span: TensorSpan, dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor in `dtype`, filled a chunk of rows at a time (the float32 of one chunk is
    the only temporary)."""
    out = torch.empty(span.num_rows, span.num_cols, dtype=dtype)
    with path.open("rb") as f:
        for start in range(0, span.num_rows, _step(span.num_cols)):
            stop = min(span.num_rows, start + _step(span.num_cols))
            out[start:stop] = read_rows(f.fileno(), span, start, stop)
    return out.view(span.shape)


@dataclass(slots=True)
class Int8Stream:
    """The projections of one GGUF file by checkpoint name, each read and quantized when asked
    for (`int8_rows`): rows are rounded to `dtype` first, as `quantize_int8` quantizes a model
    built in `dtype`, so the result equals dequantizing everything and quantizing after.
    `progress`: counts the projections read (the first time each is)."""

    path: Path
    dtype: torch.dtype
    spans: dict[str, TensorSpan]
    row_orders: dict[str, RowOrder] = field(default_factory=dict)
    progress: Progress | None = None
    names_read: set[str] = field(default_factory=set)

    def int8_rows(self, name: str) -> Int8Rows:
        span = self.spans[name]
        if len(span.shape) != 2:
            raise ConfigRejected(f"GGUF tensor for {name} has shape {span.shape}, not a matrix", "model")
        with self.path.open("rb") as f:
            q, scale = quantize_rows(
                lambda start, stop: read_rows(f.fileno(), span, start, stop).to(self.dtype), *span.shape
            )
        if order := self.row_orders.get(name):
            q, scale = order(q), order(scale[:, None])[:, 0]
        self.names_read.add(name)
        if self.progress is not None:
            self.progress.update(len(self.names_read))
        return q, scale
