"""The w8a8 C++ kernel (`w8a8_kernel.cpp`) gives bit-identical results to the torch path at every
row count (its matrix-vector path at 1-8 rows, blocks of 8 rows over weight tiles up to 32,
`_int_mm` inside above), on odd shapes, so a row's result never depends on its batch;
torch.compile calls it as an opaque op; where it cannot be built, w8a8 says why and keeps the
torch path."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from bridge_schema.messages import Hello
from drivers.torch import w8a8_kernel
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.quantize import DynamicInt8Linear, w8a8_reference
from tests.drivers.torch.helpers import forward, load_dir, random_tokens, request, write_tiny_llama

CAN_BUILD = cpp_extension.is_ninja_available() and shutil.which("c++") is not None
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no C++ toolchain (ninja and c++) to build the kernel")


@pytest.fixture(scope="module")
def kernel() -> None:
    assert w8a8_kernel.load(show_progress=False), "the kernel did not build (see the logged reason)"


def _linear(n: int, k: int, seed: int, rows: int = 9) -> tuple[torch.Tensor, DynamicInt8Linear]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * 3, DynamicInt8Linear(torch.randn(n, k, generator=g), None, True)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(1, 64), (7, 100), (33, 130), (96, 576), (40, 1536)])
def test_kernel_equals_torch_path_exactly(kernel: None, n: int, k: int) -> None:
    x, lin = _linear(n, k, seed=n + k)
    x[2] = 0.0  # an all-zero row: its scale is clamped, its output 0
    x[3, : k // 2] *= 1000  # one large half: most of the row rounds to 0
    for m in (1, 2, 3, 5, 8, 9):  # 1-8: the matrix-vector path; 9: `_int_mm` inside the kernel
        got = torch.ops.wafer.w8a8_linear(x[:m], lin.weight_int8, lin.scale, lin.weight_sum)
        assert torch.equal(got, w8a8_reference(x[:m], lin.weight_int8, lin.scale)), (n, k, m)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(7, 100), (61, 130), (96, 576), (45, 1536)])
def test_kernel_in_row_blocks_equals_torch_path_exactly(kernel: None, n: int, k: int) -> None:
    # n spans several weight tiles (odd n: the tiles' last row runs alone) at k = 576 and 1536.
    x, lin = _linear(n, k, seed=n * k, rows=65)
    x[10] = 0.0
    x[17, : k // 2] *= 1000
    for m in (9, 16, 31, 32, 33, 64, 65):  # 9-32: blocks of 8 rows and a remainder; 33-65: `_int_mm`
        got = torch.ops.wafer.w8a8_linear(x[:m], lin.weight_int8, lin.scale, lin.weight_sum)
        assert torch.equal(got, w8a8_reference(x[:m], lin.weight_int8, lin.scale)), (n, k, m)


@needs_kernel
def test_kernel_row_does_not_depend_on_its_batch(kernel: None) -> None:
    x, lin = _linear(200, 576, seed=1)
    big = torch.cat([x, x * 50, -x])  # 27 rows: blocks of 8 over weight tiles
    alone = lin(x[:1])
    for batch in (x[:4], x, big, torch.cat([big, big[:5]]), torch.cat([big, big, -big])):  # 32, 81 rows
        y = lin(batch)
        assert torch.equal(y[:1], alone)
        assert torch.equal(y[-1:], lin(batch[-1:]))  # the last row, in the last (partial) block


@needs_kernel
def test_compiled_call_is_opaque_and_equal(kernel: None) -> None:
    x, lin = _linear(48, 96, seed=2)
    compiled = torch.compile(lin, fullgraph=True)
    assert torch.equal(compiled(x[:1]), lin(x[:1]))


@needs_kernel
def test_driver_kernel_equals_torch_path(kernel: None, tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    drivers = [TorchDriver(ckpt, DriverOptions(weights="w8a8", w8a8_kernel=on, num_pages=8)) for on in (True, False)]
    assert [d.model.model.layers[0].mlp.down_proj.use_kernel for d in drivers] == [True, False]
    prompt = random_tokens(13, 96, seed=4)
    for drv in drivers:
        drv.handshake(Hello())
    got, want = (d.logits(forward([request(prompt, 0, range(8), 16, all_rows=True)])) for d in drivers)
    assert torch.equal(got, want)
    nxt = [int(got[-1].argmax())]
    got, want = (d.logits(forward([request(nxt, len(prompt), range(8), 16)])) for d in drivers)
    assert torch.equal(got, want)


def test_without_a_toolchain_w8a8_says_why_and_keeps_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(w8a8_kernel, "_state", {})
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=w8a8_kernel.__name__):
        drv = TorchDriver(load_dir(write_tiny_llama(tmp_path / "m")), DriverOptions(weights="w8a8", num_pages=8))
    assert "ninja is not installed" in caplog.text
    assert not drv.model.model.layers[0].self_attn.o_proj.use_kernel
    drv.handshake(Hello())
    assert drv.forward(forward([request([1, 2, 3], 0, range(8), 16)])).tokens.shape == (1,)


def test_a_failed_build_says_why(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension 'x': [1/2] c++ ...\nw8a8_kernel.cpp:1: error: no avx512")

    monkeypatch.setattr(w8a8_kernel, "_state", {})
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger=w8a8_kernel.__name__):
        assert not w8a8_kernel.load(show_progress=False)
    assert "error: no avx512" in caplog.text
