"""The C++ CPU kernels (`cpu_kernels.py`).

Every kernel runs in each instruction-set variant this CPU supports (`ISA`: the variants are
forced with `cpu_kernels.limit_isa`, so an AVX-512 machine tests the AVX2 and portable code too);
a variant the CPU lacks is skipped, naming the missing feature.

w8a8 (`w8a8_kernel.cpp`) reads its weights where `pack_vnni` puts them and gives bit-identical
results to the torch path at every row count (one block of rows, half panels, balanced blocks),
on odd shapes, so a row's result never depends on its batch, in every variant, with one row's
weights cut between threads mid-panel, and on its float32 matmul path; it refuses weights packed
for another shape; torch.compile calls it as an opaque op; where it cannot be built, w8a8 says
why and keeps the torch path.

Decode attention (`decode_attention.cpp`, vectorized and portable) equals the reference attention
to float32 rounding at every head size and grouping, over keys with holes, repeats and padding,
gives zeros to requests that attend to nothing, and refuses a key slot outside the cache; the
driver runs it for decode passes in float32, eager and compiled, with the same logits as the torch
paths, sliding windows and sinks included."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils import cpp_extension

from bridge_schema.messages import Hello
from drivers.errors import ConfigRejected
from drivers.torch import sampling
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.kernels import cpu_kernels
from drivers.torch.kernels.attention_ref import masked_attention
from drivers.torch.runners.direct_graphs import DirectGraphs
from drivers.torch.weights import quantize
from drivers.torch.weights.quantize import DynamicInt8Linear, choose_matmuls, pack_vnni, w8a8_reference
from tests.drivers.torch.helpers import (
    forward,
    load_dir,
    make_driver,
    needs_kernel,
    random_tokens,
    request,
    write_tiny_gemma,
    write_tiny_llama,
)


def _linear(n: int, k: int, seed: int, rows: int = 9) -> tuple[torch.Tensor, DynamicInt8Linear]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * 3, DynamicInt8Linear(torch.randn(n, k, generator=g), None, True)


def _torch_path(lin: DynamicInt8Linear, k: int) -> DynamicInt8Linear:
    """The same weights on the torch path ([out, in], unpacked from the kernel's panels)."""
    n = lin.scale.numel()
    panels = (
        lin.weight_int8.view(-1, -(-k // 4), 4, 16, 4)
        .permute(0, 2, 3, 1, 4)
        .reshape(-1, lin.weight_int8.shape[1] // 64)
    )
    plain = DynamicInt8Linear(torch.zeros(n, k), None, False)
    plain.weight_int8, plain.scale, plain.weight_sum = panels[:n, :k].contiguous(), lin.scale, lin.weight_sum
    return plain


def test_vnni_panels_hold_each_weight_where_the_kernel_reads_it() -> None:
    q = torch.randint(-127, 128, (70, 10), dtype=torch.int8)
    packed = pack_vnni(q)
    assert packed.shape == (2, 3 * 256)  # 70 outputs -> 2 panels of 64; 10 inputs -> 3 quads
    flat = packed.view(-1)
    for out in (0, 15, 16, 63, 64, 69):
        for k in (0, 3, 4, 9):
            p, b, c = out // 64, out % 64 // 16, out % 16
            assert flat[p * 768 + k // 4 * 256 + b * 64 + c * 4 + k % 4] == q[out, k]
    assert int(packed.abs().sum()) == int(q.abs().sum())  # everything else is zero padding


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(1, 64), (7, 99), (33, 130), (64, 577), (96, 576), (130, 1536)])
def test_kernel_equals_torch_path_exactly(isa: dict[str, str], n: int, k: int) -> None:
    # n: one partial panel, a panel exactly, a full one and a partial; k: not multiples of 4 or 64.
    x, lin = _linear(n, k, seed=n + k, rows=65)
    plain = _torch_path(lin, k)
    torch.testing.assert_close(lin.scale, plain.scale)
    x[2] = 0.0  # an all-zero row: its scale is clamped, its output 0
    x[3, : k // 2] *= 1000  # one large half: most of the row rounds to 0
    # 1-6 rows: one block; 7, 8: two half panels; more: balanced blocks of at most 6, prefetching.
    for m in (*range(1, 10), 12, 13, 16, 31, 32, 33, 64, 65):
        assert torch.equal(lin(x[:m]), plain(x[:m])), (isa["w8a8"], n, k, m)
        assert torch.equal(plain(x[:m]), w8a8_reference(x[:m], plain.weight_int8, plain.scale))


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Sets torch's thread count for a test (the suite runs on one), restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(64, 2100), (130, 1536), (576, 576), (960, 577), (1000, 99)])
def test_one_row_split_over_threads_equals_torch_path_exactly(
    isa: dict[str, str], threads: Callable[[int], None], n: int, k: int
) -> None:
    # One row's weights are cut into even ranges of k-quads, one a thread: a range may begin and
    # end inside a panel (64 outputs: 1 panel), cut a panel between several threads (3 panels of
    # 384 quads on 2, 3 and 5 threads), or hold whole panels only; too few quads (1000 x 99: 400)
    # for more than one thread keep the panel split.
    x, lin = _linear(n, k, seed=n * k, rows=3)
    plain = _torch_path(lin, k)
    x[1, : k // 2] *= 1000
    for t in (1, 2, 3, 5):
        threads(t)
        for row in range(3):
            assert torch.equal(lin(x[row : row + 1]), plain(x[row : row + 1])), (isa["w8a8"], n, k, t, row)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(7, 99), (130, 1536), (70, 2100)])
def test_float32_matmul_path_equals_torch_path_exactly(kernel: None, n: int, k: int) -> None:
    # Every weight and activation at +-127: a 2100-long sum (34M) is past float32's exact integers
    # (2^24), so only the blocks of at most 1024 inputs keep the float path exact.
    x, lin = _linear(n, k, seed=k, rows=33)
    x[0], x[1] = 1.0, -1.0
    q = _torch_path(lin, k).weight_int8.clone()
    q[0] = 127
    lin.weight_int8, lin.weight_sum = pack_vnni(q), q.sum(dim=1, dtype=torch.int32)
    plain = _torch_path(lin, k)
    assert int(plain.weight_int8[0].sum()) == 127 * k
    for m in (1, 2, 5, 33):
        got = torch.ops.wafer.w8a8_linear(x[:m], lin.weight_int8, lin.scale, lin.weight_sum, 1)
        assert torch.equal(got, plain(x[:m])), (n, k, m)
    lin.sgemm_from_rows = 5  # from 5 rows on
    assert torch.equal(lin(x[:4]), plain(x[:4])) and torch.equal(lin(x), plain(x))


def _packed_copy(lin: DynamicInt8Linear) -> DynamicInt8Linear:
    """The same weights read from one tensor (`use_packed`), and its three tensors then set to
    other values: what it computes comes from the packed tensor alone."""
    other = DynamicInt8Linear(torch.zeros(lin.out_features, lin.in_features), None, True)
    other.use_packed(lin.packed_bytes().clone())
    other.weight_int8 = torch.zeros_like(lin.weight_int8)
    other.scale, other.weight_sum = torch.zeros_like(lin.scale), torch.zeros_like(lin.weight_sum)
    return other


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(7, 99), (130, 1536), (576, 576), (1000, 99)])
def test_packed_weights_give_the_same_bits(isa: dict[str, str], threads: Callable[[int], None], n: int, k: int) -> None:
    # One tensor of panels, scales and sums (`w8a8_linear_packed`, what a packed model's graphs
    # call) against the three tensors: one row split over threads, blocks of rows, the float path.
    x, lin = _linear(n, k, seed=n + 7 * k, rows=33)
    packed = _packed_copy(lin)
    for t in (1, 2, 3):
        threads(t)
        for m in (1, 2, 7, 33):
            assert torch.equal(packed(x[:m]), lin(x[:m])), (isa["w8a8"], n, k, t, m)
    assert torch.equal(packed.kernel(x, 1), lin.kernel(x, 1))


@needs_kernel
def test_packed_kernel_refuses_a_tensor_of_another_size(kernel: None) -> None:
    x, lin = _linear(70, 96, seed=3)
    blob = lin.packed_bytes()
    with pytest.raises(RuntimeError, match=r"70 outputs of 100 inputs need 13360"):
        torch.ops.wafer.w8a8_linear_packed(torch.zeros(2, 100), blob, 70)
    with pytest.raises(RuntimeError, match=r"packed holds 12848 bytes; 71 outputs"):
        torch.ops.wafer.w8a8_linear_packed(x, blob, 71)
    with pytest.raises(RuntimeError, match="contiguous 1-D int8"):
        torch.ops.wafer.w8a8_linear_packed(x, blob.view(torch.int32), 70)
    assert torch.equal(torch.ops.wafer.w8a8_linear_packed(x, blob, 70), lin(x))


@needs_kernel
def test_choose_matmuls_sets_a_row_count_per_shape(kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    lins = [DynamicInt8Linear(torch.randn(n, k), None, True) for n, k in ((64, 96), (64, 96), (32, 48))]
    choices = choose_matmuls(lins)
    assert set(choices) == {(64, 96), (32, 48)}
    assert [lin.sgemm_from_rows for lin in lins] == [choices[(64, 96)], choices[(64, 96)], choices[(32, 48)]]
    # Whichever is measured faster is taken: a float path that is always faster, from 64 rows.
    times = iter([2.0, 1.0] * 8)
    monkeypatch.setattr(quantize, "_best_time", lambda fn: next(times))
    assert choose_matmuls(lins[:1]) == {(64, 96): 64} and lins[0].sgemm_from_rows == 64
    times = iter([1.0, 2.0] * 8)
    assert choose_matmuls(lins[:1]) == {(64, 96): 0} and lins[0].sgemm_from_rows == 0


@needs_kernel
def test_kernel_refuses_weights_packed_for_another_shape(kernel: None) -> None:
    x, lin = _linear(70, 96, seed=3)
    with pytest.raises(RuntimeError, match="not packed for x's input size 100"):
        torch.ops.wafer.w8a8_linear(torch.zeros(2, 100), lin.weight_int8, lin.scale, lin.weight_sum)
    with pytest.raises(RuntimeError, match="do not hold w_scale's 130 outputs"):
        torch.ops.wafer.w8a8_linear(x, lin.weight_int8, torch.ones(130), torch.zeros(130, dtype=torch.int32))


@needs_kernel
def test_kernel_row_does_not_depend_on_its_batch(isa: dict[str, str]) -> None:
    x, lin = _linear(200, 576, seed=1)
    big = torch.cat([x, x * 50, -x])  # 27 rows: 5 blocks of 6 and 5 rows
    alone = lin(x[:1])
    for batch in (x[:4], x, big, torch.cat([big, big[:5]]), torch.cat([big, big, -big])):  # 32, 81 rows
        y = lin(batch)
        assert torch.equal(y[:1], alone)
        assert torch.equal(y[-1:], lin(batch[-1:]))  # the last row, in the last (partial) block


@needs_kernel
def test_compiled_call_is_opaque_and_equal(kernel: None) -> None:
    # As the compiled model calls it: keyed by the kernels' sources in Inductor's cache.
    x, lin = _linear(48, 96, seed=2)
    compiled = DirectGraphs(_apply, cpu_kernels.source_digest())
    for _ in range(2):  # compiles, then calls the graph directly
        assert torch.equal(compiled(lin, x[:3]), lin(x[:3]))
    assert compiled.num_direct_calls == 1


def _apply(lin: DynamicInt8Linear, x: torch.Tensor) -> torch.Tensor:
    return lin(x)


@needs_kernel
def test_driver_kernel_equals_torch_path(kernel: None, tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    # The model's path on both (the fused decode step, test_fused_decode.py, rounds its norms and
    # SiLU its own way): the matmuls alone are compared here.
    options = [DriverOptions(weights="w8a8", w8a8_kernel=on, num_pages=8, fused_decode=False) for on in (True, False)]
    drivers = [TorchDriver(ckpt, o) for o in options]
    assert [d.model.model.layers[0].mlp.down_proj.use_kernel for d in drivers] == [True, False]
    prompt = random_tokens(13, 96, seed=4)
    for drv in drivers:
        drv.handshake(Hello())
    got, want = (d.logits(forward([request(prompt, 0, range(8), 16, all_rows=True)])) for d in drivers)
    assert torch.equal(got, want)
    nxt = [int(got[-1].argmax())]
    got, want = (d.logits(forward([request(nxt, len(prompt), range(8), 16)])) for d in drivers)
    assert torch.equal(got, want)


@needs_kernel
def test_kernels_run_on_torchs_threads(kernel: None) -> None:
    # Built without OpenMP, ATen's parallel_for inside the kernels is serial at any thread count.
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.ops.wafer.parallel_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_the_ninja_package_builds_where_path_has_no_ninja(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A venv's python run without activation (`make run`) on a machine with no system ninja: the
    # `ninja` package's binary is not on PATH, and without it the kernels were never built.
    ninja = pytest.importorskip("ninja", reason="the ninja package (the torch extra's) is not installed")
    if not ninja.BIN_DIR:  # e.g. installed with pip --target (make arm-check's Python)
        pytest.skip("the ninja package cannot find its own binary here")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not cpp_extension.is_ninja_available()
    cpu_kernels.ninja_on_path()
    assert cpp_extension.is_ninja_available()
    assert os.environ["PATH"].endswith(os.pathsep + str(tmp_path))  # added before, nothing lost


def test_without_torchs_extension_loader_the_kernels_say_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # torch.utils.cpp_extension imports setuptools, which a Python 3.12 venv does not have unless
    # something installs it: the driver then starts on the torch paths, it does not crash.
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.delattr(torch.utils, "cpp_extension")
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # importing it raises ImportError
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert not cpu_kernels.load(show_progress=False)
    assert "C++ CPU kernels not built (" in caplog.text and "cpp_extension" in caplog.text


def test_without_a_toolchain_w8a8_says_why_and_keeps_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        drv = TorchDriver(load_dir(write_tiny_llama(tmp_path / "m")), DriverOptions(weights="w8a8", num_pages=8))
    assert "ninja is not installed" in caplog.text
    assert not drv.model.model.layers[0].self_attn.o_proj.use_kernel
    drv.handshake(Hello())
    assert drv.forward(forward([request([1, 2, 3], 0, range(8), 16)])).tokens.shape == (1,)


@needs_kernel
def test_a_cpu_without_vector_variants_runs_the_portable_kernels(kernel: None, tmp_path: Path) -> None:
    # The portable variants: correct on any CPU (never an error at run time), and said so.
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    with cpu_kernels.limit_isa("portable") as chosen:
        assert chosen == dict.fromkeys(cpu_kernels.KERNELS, "portable")
        assert "correct, not fast" in cpu_kernels.describe()
        drv = TorchDriver(ckpt, DriverOptions(weights="w8a8", w8a8_kernel=True, num_pages=8))
        plain = TorchDriver(ckpt, DriverOptions(weights="w8a8", w8a8_kernel=False, num_pages=8))
        assert drv.model.model.layers[0].self_attn.o_proj.use_kernel
        for d in (drv, plain):
            d.handshake(Hello())
        spec = [request(random_tokens(9, 96, seed=1), 0, range(8), 16, all_rows=True)]
        assert torch.equal(drv.logits(forward(spec)), plain.logits(forward(spec)))


@needs_kernel
def test_the_isa_cap_takes_known_levels_only(kernel: None) -> None:
    with pytest.raises(ValueError, match="unknown instruction-set level 'sse9'"):
        cpu_kernels.set_isa_cap("sse9")
    with pytest.raises(RuntimeError, match="unknown instruction-set level"):
        torch.ops.wafer.set_isa_cap("sse9")
    best = cpu_kernels.cpu_isas()[-1]
    assert cpu_kernels.cpu_isas()[0] == "portable"
    with cpu_kernels.limit_isa("portable"):
        assert cpu_kernels.cpu_isas()[-1] == best  # the cap limits the kernels, not what the CPU has
    assert set(cpu_kernels.variants().values()) <= set(cpu_kernels.cpu_isas())


def test_a_failed_build_says_why(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension 'x': [1/2] c++ ...\nw8a8_kernel.cpp:1: error: no avx512")

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert not cpu_kernels.load(show_progress=False)
    assert "error: no avx512" in caplog.text


def test_the_build_goes_where_torch_extensions_dir_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_EXTENSIONS_DIR moves the build (torch's own loader honours it; a read-only home
    needs it), and without it the build goes to torch's default root."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    directory = cpu_kernels.build_directory("wafer_cpu_test")
    assert directory.parent == tmp_path / "ext" and directory.is_dir()
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cpu_kernels.build_directory("wafer_cpu_test").parent == Path(cpp_extension.get_default_build_root())
    cpu_kernels.build_directory("wafer_cpu_test").rmdir()


def test_the_build_compiles_copies_of_the_sources_in_its_own_folder(kernel: None) -> None:
    """Two checkouts of the same sources share the build (its name is their hash); compiled from
    each checkout's own paths, ninja saw a new command at every other start and rebuilt (~1 min).
    The build compiles copies in its folder instead, the same paths from every checkout."""
    directory = cpu_kernels.build_directory(f"wafer_cpu_{cpu_kernels.source_digest()}")
    compiled = [
        line.split()[-1]
        for line in (directory / "build.ninja").read_text().splitlines()
        if line.startswith("build ") and ": compile " in line
    ]
    assert sorted(Path(c).name for c in compiled) == sorted(s.name for s in cpu_kernels.SOURCES)
    assert all(Path(c).parent == directory / "src" for c in compiled), compiled


def test_each_torch_install_has_its_own_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two venvs with the same torch version compile with different include paths: sharing one
    folder, each start from the other venv rebuilt the kernels (~35 s; seen with a CI clone's venv)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = cpu_kernels.build_directory("wafer_cpu_test")
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    there = cpu_kernels.build_directory("wafer_cpu_test")
    assert here != there and here.parent == there.parent == tmp_path


def test_staged_sources_are_written_only_when_they_differ(tmp_path: Path) -> None:
    """An unchanged copy keeps its time stamp (ninja would rebuild from a newer one)."""
    copies = cpu_kernels.staged_sources(tmp_path)
    assert [c.read_bytes() for c in copies] == [s.read_bytes() for s in cpu_kernels.SOURCES]
    headers = [tmp_path / "src" / h.name for h in cpu_kernels.HEADERS]
    assert [h.read_bytes() for h in headers] == [h.read_bytes() for h in cpu_kernels.HEADERS]
    stamps = [c.stat().st_mtime_ns for c in (*copies, *headers)]
    time.sleep(0.01)
    assert cpu_kernels.staged_sources(tmp_path) == copies
    assert [c.stat().st_mtime_ns for c in (*copies, *headers)] == stamps
    headers[0].write_text("// an older version\n")
    cpu_kernels.staged_sources(tmp_path)
    assert headers[0].read_bytes() == cpu_kernels.HEADERS[0].read_bytes()


def test_a_build_killed_halfway_does_not_block_the_next_start(kernel: None) -> None:
    """torch's loader waits for as long as its lock file exists; a driver killed while it built
    the kernels left one behind, and every later start hung. The next start goes on now."""
    directory = cpu_kernels.build_directory(f"wafer_cpu_{cpu_kernels.source_digest()}")
    (directory / "lock").touch()  # what a killed build leaves
    probe = "from drivers.torch.kernels import cpu_kernels; print(cpu_kernels.load(show_progress=False))"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[3]
        )
    finally:
        (directory / "lock").unlink(missing_ok=True)
    assert done.stdout.strip() == "True", done.stderr
    assert "left by a kernel build that did not finish" in done.stderr


# ---------------------------------------------------------------------------- decode attention

ATTENTION_OPS = ["decode_attention", "decode_attention_portable"]


def _attention_inputs(
    h: int, hkv: int, d: int, valid: list[int], seed: int, spread: float = 1.0, kv_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """q [B, H, D], a cache of 3 * max(valid) + 5 slots, and per request `valid[b]` keys at random
    slots (repeats allowed) followed by padding; valid 0 = a request that attends to nothing."""
    g = torch.Generator().manual_seed(seed)
    b, width, slots = len(valid), max(max(valid), 1) + 3, 3 * max(valid) + 5
    q = torch.randn(b, h, d, generator=g) * spread
    k_cache, v_cache = (torch.randn(slots, hkv, d, generator=g).to(kv_dtype) for _ in range(2))
    key_index = torch.randint(0, slots, (b, width), generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor(valid)[:, None]
    key_index[~mask] = 0  # padding reads slot 0, masked out
    empty = ~mask.any(-1)
    return q, k_cache, v_cache, key_index, mask | empty[:, None], empty  # empty rows opened (a safe mask)


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_index: torch.Tensor,
    mask: torch.Tensor,
    empty: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    k, v = k_cache[key_index].to(q.dtype), v_cache[key_index].to(q.dtype)
    return masked_attention(q[:, None], k, v, mask[:, None], scale, empty[:, None])[:, 0]


@needs_kernel
@pytest.mark.parametrize("op", ATTENTION_OPS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("h", "hkv", "d"),
    [(9, 3, 64), (4, 4, 16), (8, 2, 20), (2, 1, 256), (6, 3, 8), (4, 2, 128), (3, 1, 33), (2, 1, 100)],
)
def test_decode_attention_equals_reference(
    isa: dict[str, str], op: str, kv_dtype: torch.dtype, h: int, hkv: int, d: int
) -> None:
    # 16 and 32 keys fill blocks of 16 exactly; 17 and 47 leave a remainder; 0 attends to nothing.
    # A float16 or bfloat16 cache is read as the float32 values it holds.
    valid = [80, 1, 16, 0, 17, 32, 47, 3]
    args = _attention_inputs(h, hkv, d, valid, seed=h * d, kv_dtype=kv_dtype)
    got = getattr(torch.ops.wafer, op)(*args, d**-0.5)
    want = _reference(*args, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros(h, d))  # the empty request


@needs_kernel
@pytest.mark.parametrize("op", ATTENTION_OPS)
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 2, 20)])
def test_decode_attention_over_pieces_is_the_same_alone_in_a_batch_and_on_any_threads(
    isa: dict[str, str], threads: Callable[[int], None], op: str, h: int, hkv: int, d: int
) -> None:
    # Key lists run as pieces over the threads, merged in order: of 64 keys up to 512 keys (64 is
    # one piece, 65 two, the second of one key; 512 eight), of 256 past that (513 three, the last of
    # one key; 600 three; 1100 five), shared among the threads by their keys; results equal the
    # reference to float32 rounding and are bit-identical alone, in a batch and on 1, 2 or 3 threads.
    valid = [600, 0, 64, 65, 30, 512, 513, 1100, 200]
    args = _attention_inputs(h, hkv, d, valid, seed=d, spread=3.0)
    attend = getattr(torch.ops.wafer, op)
    want = _reference(*args, d**-0.5)
    q, k_cache, v_cache, key_index, mask, empty = args
    for t in (1, 2, 3):
        threads(t)
        got = attend(*args, d**-0.5)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        for r in range(len(valid)):
            alone = attend(
                q[r : r + 1], k_cache, v_cache, key_index[r : r + 1], mask[r : r + 1], empty[r : r + 1], d**-0.5
            )
            assert torch.equal(alone[0], got[r]), (isa["decode_attention"], t, r)


@needs_kernel
@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_decode_attention_is_as_accurate_as_the_reference(isa: dict[str, str], op: str) -> None:
    # Large scores: exp underflows for all but a few keys, and a score's float32 rounding moves its
    # weight visibly; tiny scores: nearly uniform weights. Both against float64 attention: the
    # kernel's error stays within that of the float32 reference.
    for spread in (40.0, 1e-3):
        args = _attention_inputs(6, 2, 64, [50, 9, 33], seed=7, spread=spread)
        exact = _reference(*(a.double() if a.is_floating_point() else a for a in args), 0.125)
        got = getattr(torch.ops.wafer, op)(*args, 0.125).double()
        ref_err = (_reference(*args, 0.125).double() - exact).abs().max().item()
        assert (got - exact).abs().max().item() <= 2 * ref_err + 1e-6, spread


@needs_kernel
@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_decode_attention_refuses_a_slot_outside_the_cache(kernel: None, op: str) -> None:
    q, k_cache, v_cache, key_index, mask, empty = _attention_inputs(4, 2, 16, [5, 5], seed=1)
    key_index[1, 2] = k_cache.shape[0]  # a key the request reads
    with pytest.raises(RuntimeError, match=r"key_index: slot .* of request 1 outside the cache"):
        getattr(torch.ops.wafer, op)(q, k_cache, v_cache, key_index, mask, empty, 0.25)
    key_index[1, 2], key_index[1, 6] = 0, -(10**9)  # a padding key: never read, so accepted
    torch.ops.wafer.decode_attention(q, k_cache, v_cache, key_index, mask, empty, 0.25)


@needs_kernel
@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_decode_attention_refuses_a_mask_that_does_not_cover_its_keys(kernel: None, op: str) -> None:
    # Never applied positionally or past its end: a mask shorter than the keys is an error.
    q, k_cache, v_cache, key_index, mask, empty = _attention_inputs(4, 2, 16, [5, 7], seed=2)
    with pytest.raises(RuntimeError, match=r"mask: \[B, K\] bool"):
        getattr(torch.ops.wafer, op)(q, k_cache, v_cache, key_index, mask[:, :-1], empty, 0.25)


def _with_op_calls(fn: Callable[[], list[torch.Tensor]]) -> tuple[list[torch.Tensor], int]:
    """What `fn` returns, and how many times it called `wafer::decode_attention`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key == "wafer::decode_attention")


def _decode_logits(drv: TorchDriver, ps: int) -> list[torch.Tensor]:
    """A prefill of three prompts, three decode steps of all three, one of the first alone."""
    prompts = [random_tokens(n, 96, seed=n) for n in (11, 6, 19)]
    pages = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    out = [drv.logits(forward([request(p, 0, pages[i], ps, context_id=i) for i, p in enumerate(prompts)]))]
    last = out[-1].argmax(-1).tolist()
    for step, live in enumerate([range(3), range(3), range(3), range(1)]):
        specs = [request([last[i]], len(prompts[i]) + step, pages[i], ps, context_id=i) for i in live]
        out.append(drv.logits(forward(specs)))
        last = out[-1].argmax(-1).tolist()
    return out


@needs_kernel
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kv_dtype", ["", "float16"])
def test_driver_decode_attention_equals_torch_paths(kernel: None, tmp_path: Path, compile: bool, kv_dtype: str) -> None:
    # Sliding windows of 4 with 2 sinks on alternate layers: the keys a family reads.
    ckpt = load_dir(write_tiny_gemma(tmp_path / "g", sliding_window=4, num_sink_tokens=2))
    drivers = [
        TorchDriver(
            ckpt, DriverOptions(page_size=4, num_pages=24, compile=compile, attention_kernel=on, kv_dtype=kv_dtype)
        )
        for on in (True, False)
    ]
    assert [d.attention_kernel for d in drivers] == [True, False]
    for drv in drivers:
        drv.handshake(Hello())
    (got, calls_on), (want, calls_off) = (_with_op_calls(lambda d=d: _decode_logits(d, 4)) for d in drivers)
    assert (calls_on, calls_off) == (4 * 4, 0)  # four decode passes of four layers; prefill is not decode
    # With a float16 cache, Inductor's fused torch path may skip rounding a value it just wrote.
    tol = 1e-4 if compile and kv_dtype else 1e-5
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=0)


def test_a_float16_kv_cache_holds_float16_and_stays_close(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_gemma(tmp_path / "g", sliding_window=4, num_sink_tokens=2))
    drivers = [TorchDriver(ckpt, DriverOptions(page_size=4, num_pages=24, kv_dtype=kv)) for kv in ("", "float16")]
    for drv in drivers:
        drv.handshake(Hello())
    assert drivers[0].cache is not None and drivers[0].cache.k.dtype == torch.float32
    assert drivers[1].cache is not None and drivers[1].cache.k.dtype == torch.float16
    assert drivers[1].cache.size_bytes * 2 == drivers[0].cache.size_bytes
    exact, half = (_decode_logits(d, 4) for d in drivers)
    diff = max(float((a - b).abs().max()) for a, b in zip(exact, half, strict=True))
    assert 0 < diff < 0.05  # rounded K/V: close, not equal


def test_kv_dtype_is_checked(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    with pytest.raises(ConfigRejected, match="kv_dtype must be one of") as bad:
        TorchDriver(ckpt, DriverOptions(kv_dtype="int8"))
    assert bad.value.field == "kv_dtype"
    with pytest.raises(ConfigRejected, match="for the CPU only"):
        TorchDriver(ckpt, DriverOptions(device="meta", kv_dtype="float16"))


@needs_kernel
def test_attention_kernel_is_float32_cpu_only(kernel: None, tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    assert make_driver(ckpt).attention_kernel
    assert not TorchDriver(ckpt, DriverOptions(dtype="bfloat16")).attention_kernel


# ---------------------------------------------------------------------------- greedy argmax


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 8, 9, 16, 17, 100, 49152, 49153])
def test_argmax_rows_equals_torch_max_indices(isa: dict[str, str], n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(8, n, generator=g)
    x[1] = -float("inf")  # every token masked out
    x[2, n // 2] = float("nan")  # a NaN wins, as in torch
    x[3, n - 1] = x[3, n // 3] = 1e9  # a tie: the first
    x[4] = 0.0  # all equal: index 0
    x[5, -1] = 1e9  # the tail after the last full vector
    x[6, 0] = float("nan")
    x[6, -1] = float("nan")
    got = torch.ops.wafer.argmax_rows(x)
    assert torch.equal(got, x.max(-1).indices)
    assert torch.equal(cpu_kernels.argmax_rows(x), got)
    assert torch.equal(cpu_kernels.argmax_rows(x.double()), x.max(-1).indices)  # other dtypes: torch


# ---------------------------------------------------------------------------- float32 decode matmuls


@needs_kernel
@pytest.mark.parametrize(("k", "n"), [(1, 1), (7, 33), (576, 960), (1536, 576), (3, 4097), (5, 8193), (64, 100)])
def test_f32_linear_is_exact_to_float32_rounding_and_batch_and_thread_invariant(
    isa: dict[str, str], threads: Callable[[int], None], k: int, n: int
) -> None:
    # Against float64: within float32 rounding of a k-term sum. A row's bits are the same alone and
    # beside others (1-8 rows: one group of registers; 13 and the most: groups of 8 and a smaller
    # one), on 1-3 threads; the vector variants give the same bits; more than the variant's most
    # rows (24; portable 4) are torch's matmul, bit for bit.
    most = int(torch.ops.wafer.f32_linear_max_rows())
    assert most == (4 if isa["f32_linear"] == "portable" else 24)
    g = torch.Generator().manual_seed(k * n)
    w_t, x = torch.randn(k, n, generator=g), torch.randn(most + 1, k, generator=g)
    x[2, : k // 2] *= 1000  # a row with a huge half
    exact = x.double() @ w_t.double()
    scale = x.double().abs() @ w_t.double().abs()
    op = torch.ops.wafer.f32_linear_t
    alone = [op(x[row : row + 1], w_t)[0] for row in range(most)]
    for m in sorted({m for m in (1, 2, 3, 4, 5, 8, 13, most) if m <= most}):
        for t in (1, 2, 3) if m <= 4 else (2,):
            threads(t)
            got = op(x[:m], w_t)
            assert got.shape == (m, n)
            assert ((got.double() - exact[:m]).abs() <= 1e-6 * (k + 8) * scale[:m]).all(), (isa["f32_linear"], m, t)
            for row in range(m):
                assert torch.equal(alone[row], got[row]), (isa["f32_linear"], m, t, row)
    assert torch.equal(op(x, w_t), x @ w_t)  # one row more: torch's matmul
    if isa["f32_linear"] == "avx2" and "avx512" in cpu_kernels.cpu_isas():
        with cpu_kernels.limit_isa("avx512"):
            assert torch.equal(op(x[:most], w_t), got)
            assert torch.equal(op(x[:1], w_t)[0], alone[0])  # one row (AVX2 in runs of 64 columns)


@needs_kernel
def test_f32_linear_refuses_what_it_cannot_multiply(kernel: None) -> None:
    with pytest.raises(RuntimeError, match="x has 5 inputs, w_t 6"):
        torch.ops.wafer.f32_linear_t(torch.randn(1, 5), torch.randn(6, 3))
    with pytest.raises(RuntimeError, match="w_t: contiguous float32"):
        torch.ops.wafer.f32_linear_t(torch.randn(1, 6), torch.randn(3, 6).T)
    with pytest.raises(RuntimeError, match="x: float32"):
        torch.ops.wafer.f32_linear_t(torch.randn(1, 6).double(), torch.randn(6, 3))


@needs_kernel
def test_float32_decode_runs_the_f32_kernel_with_torchs_logits(kernel: None, tmp_path: Path) -> None:
    # Dense float32 on the CPU: decode rows (up to 24) through the op, prefill through torch; the
    # logits agree with the torch path's to float32 rounding; `f32_kernel=False` keeps torch's.
    # The model's path (decode passes otherwise run the fused step, test_fused_decode.py).
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    on = TorchDriver(ckpt, DriverOptions(page_size=16, num_pages=64, fused_decode=False))
    on.handshake(Hello())
    off = TorchDriver(ckpt, DriverOptions(page_size=16, num_pages=64, f32_kernel=False))
    off.handshake(Hello())
    assert on.model.output_head.use_kernel and not off.model.output_head.use_kernel
    calls = {"n": 0}
    real = torch.ops.wafer.f32_linear_t

    def counted(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return real(x, w_t)

    toks = random_tokens(9, ckpt.cfg.vocab_size, 3)
    prefill = forward([request(toks, 0, range(4), 16)])
    decode = forward([request(toks[:1], 9, range(4), 16), request(toks[1:2], 9, range(4, 8), 16)])
    for drv in (on, off):
        drv.logits(prefill)
        drv.logits(forward([request(toks, 0, range(4, 8), 16)]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.ops.wafer, "f32_linear_t", counted)
        got = on.logits(decode)
        assert calls["n"] == 1 + 4 * ckpt.cfg.num_layers  # the head, then per layer qkv, o, gate/up, down
        calls["n"] = 0
        long = random_tokens(25, ckpt.cfg.vocab_size, 4)
        on.logits(forward([request(long, 0, range(8, 12), 16)]))  # 25 rows: torch's matmul
        assert calls["n"] == 1  # but the head, for the one output row
    want = off.logits(decode)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- random sampling


def _sampling_params(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Per-row temperature, top-k, top-p, min-p and draw, mixed as requests mix them."""
    rng = np.random.default_rng(seed)
    return {
        "temperature": rng.choice([1.0, 0.7, 1.6], rows).astype(np.float32),
        "top_k": rng.choice([0, 0, 1, 7, 50], rows).astype(np.uint32),
        "top_p": rng.choice([1.0, 1.0, 0.9, 0.5], rows).astype(np.float32),
        "min_p": rng.choice([0.0, 0.0, 0.05], rows).astype(np.float32),
        "u": rng.random(rows),
    }


def _torch_sample(logits: torch.Tensor, rows: np.ndarray, p: dict[str, np.ndarray]) -> torch.Tensor:
    """`sampling.py`'s torch steps for `rows` of `logits` (the Forward's fields it reads, per output)."""
    fields = {k: np.zeros(logits.shape[0], dtype=v.dtype) for k, v in p.items() if k != "u"}
    for k in fields:
        fields[k][rows] = p[k]
    return sampling._random_tokens_torch(logits, SimpleNamespace(**fields), rows, p["u"])[0]  # type: ignore[arg-type]


def _on_an_edge(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> bool:
    """Whether float32 rounding can decide this draw: its target, a top-p or a min-p cut lies within
    1e-5 of a step of the row's cumulative distribution (computed in float64)."""
    vals = np.sort((row.double() / temperature).numpy())[::-1][:256]
    vals = vals[np.isfinite(vals)]
    probs = np.exp(vals - vals[0]) / np.exp(vals - vals[0]).sum()
    before = np.cumsum(probs) - probs
    rank = np.arange(len(probs))
    keep = ((top_k == 0) | (rank < top_k)) & ((before < top_p) | (rank == 0)) & (probs >= min_p * probs[0])
    cdf = np.cumsum(np.where(keep, probs, 0.0))
    eps = 1e-5
    return bool(
        np.min(np.abs(cdf - u * cdf[-1])) < eps
        or np.min(np.abs(before - top_p)) < eps
        or np.min(np.abs(probs - min_p * probs[0])) < eps
    )


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 96, 255, 256, 257, 1000, 8191, 8192, 16421, 32768, 49152, 49153])
def test_sample_rows_picks_the_torch_paths_token(isa: dict[str, str], n: int) -> None:
    # Every row of mixed parameters picks what the torch steps pick; only a draw that float32
    # rounding decides (the two softmaxes differ in the last bits) may differ, and none does here.
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(7, n, generator=g) * torch.tensor([[0.5], [2.0], [8.0], [3.0], [1.0], [4.0], [2.0]])
    logits[3, torch.randperm(n, generator=g)[: n * 9 // 10]] = -float("inf")  # a logit mask allows a tenth
    logits[4] = torch.sort(logits[4]).values  # ascending: every logit better than those before it
    rows = np.array([0, 1, 2, 3, 4, 6], dtype=np.int64)  # row 5 not sampled
    mismatched = 0
    for seed in range(6):
        p = _sampling_params(len(rows), seed * 1000 + n)
        got = cpu_kernels.sample_rows(logits, rows, p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["u"])
        assert got is not None and got.dtype == torch.int64
        want = _torch_sample(logits, rows, p)
        for i in np.flatnonzero((got != want).numpy()):
            args = (float(p["temperature"][i]), int(p["top_k"][i]), float(p["top_p"][i]), float(p["min_p"][i]))
            assert _on_an_edge(logits[rows[i]], *args, float(p["u"][i])), f"row {rows[i]}: {got[i]} != {want[i]}"
            mismatched += 1
    assert mismatched == 0  # holds for these seeds (and tells when a change moves a pick)


@needs_kernel
def test_sample_rows_ties_nan_and_infinities(isa: dict[str, str]) -> None:
    n = 49152
    x = torch.zeros(6, n)
    x[1, 7] = x[1, 40000] = 5.0  # two equally likely tokens far above the rest: the lower id first
    x[2] = -float("inf")  # nothing allowed: the first maximum, as greedy
    x[3, 100] = x[3, 30000] = float("nan")  # the first NaN, as greedy
    x[4, 9] = x[4, 20] = float("inf")  # an infinite logit: the first one
    x[5, :300] = -float("inf")  # the first 300 tokens masked out
    rows = np.arange(6, dtype=np.int64)
    ones, zeros = np.ones(6, np.float32), np.zeros(6, np.float32)

    def pick(top_k: int, u: float) -> list[int]:
        got = cpu_kernels.sample_rows(x, rows, ones, np.full(6, top_k, np.uint32), ones, zeros, np.full(6, u))
        assert got is not None
        return got.tolist()

    assert pick(1, 0.99) == [0, 7, 0, 100, 9, 300]  # top-k 1: the first of the tied best
    low, high = pick(0, 0.0), pick(0, 0.999999)
    assert (low[0], high[0]) == (0, 255)  # all equal: the 256 lowest ids, in order
    assert (low[5], high[5]) == (300, 555)  # -inf logits are never kept
    assert pick(2, 0.0)[1] == 7 and pick(2, 0.999999)[1] == 40000  # tied tokens share the mass in id order
    assert low[2:5] == [0, 100, 9] and high[2:5] == [0, 100, 9]  # the draw changes nothing there


@needs_kernel
def test_a_rows_sample_does_not_depend_on_its_batch(kernel: None) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 49152, generator=g) * 3
    rows = np.arange(9, dtype=np.int64)
    p = _sampling_params(9, 11)
    batch = cpu_kernels.sample_rows(logits, rows, p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["u"])
    assert batch is not None
    for r in range(9):
        one = {k: v[r : r + 1] for k, v in p.items()}
        alone = cpu_kernels.sample_rows(
            logits, rows[r : r + 1], one["temperature"], one["top_k"], one["top_p"], one["min_p"], one["u"]
        )
        assert alone is not None and int(alone[0]) == int(batch[r])


@needs_kernel
def test_sample_rows_refuses_bad_arguments(kernel: None) -> None:
    x = torch.randn(2, 50)
    one = (np.ones(1, np.float32), np.zeros(1, np.int64), np.ones(1, np.float32), np.zeros(1, np.float32))
    params = [torch.from_numpy(a) for a in one]
    with pytest.raises(RuntimeError, match="rows: row 2 is not a row of the logits"):
        torch.ops.wafer.sample_rows(x, torch.tensor([2]), *params, torch.ones(1).double())
    with pytest.raises(RuntimeError, match="u: one per row, Double"):
        torch.ops.wafer.sample_rows(x, torch.tensor([0]), *params, torch.ones(2).double())
    with pytest.raises(RuntimeError, match="logits: float32"):
        torch.ops.wafer.sample_rows(x.double(), torch.tensor([0]), *params, torch.ones(1).double())
    # Not float32 CPU logits: the caller keeps the torch path.
    assert cpu_kernels.sample_rows(x.double(), np.zeros(1, np.int64), *one, np.ones(1)) is None


@needs_kernel
def test_the_driver_reports_its_kernels_variants(
    kernel: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # In the log at start, the handshake's driver_info and health, as the cap sets them.
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    best = cpu_kernels.variants()
    with caplog.at_level(logging.INFO, logger="drivers.torch.driver"):
        drv = TorchDriver(ckpt, DriverOptions(weights="w8a8", num_pages=8))
    line = ", ".join(f"{k} {best[k]}" for k in ("w8a8", "decode_attention", "argmax", "sample"))
    assert f"CPU kernels: {line}" in caplog.text and "; CPU supports portable" in caplog.text
    # A CPU with no vector variant at all (an ARM CPU) says so in the same line.
    no_vector = "(no vector variant for this CPU: correct, not fast)"
    assert (no_vector in caplog.text) == all(v == "portable" for v in best.values())
    info = drv.handshake(Hello()).driver_info
    assert info["device"] == "cpu" and info["weights"] == "w8a8"
    assert str(info["cpu_kernels"]).startswith(line)
    with cpu_kernels.limit_isa("portable"):
        assert str(drv.health()["cpu_kernels"]).startswith("w8a8 portable, decode_attention portable")


@needs_kernel
def test_the_driver_names_the_faster_configuration(kernel: None, tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    if cpu_kernels.variants()["w8a8"] == "portable":  # an ARM CPU (the next test covers it)
        pytest.skip(f"this CPU has no vector int8 kernel (supports {' '.join(cpu_kernels.cpu_isas())})")

    def hint(**options: object) -> str:
        return TorchDriver(ckpt, DriverOptions(num_pages=8, **options)).faster_configuration()  # type: ignore[arg-type]

    default = hint()
    assert default.startswith("faster on this CPU: --weights w8a8 --compile --kv-dtype float16 (int8 matmuls run the ")
    assert f"the {cpu_kernels.variants()['w8a8']} kernel" in default
    assert default.endswith(
        "with wafer serve: --driver-arg=--weights --driver-arg=w8a8 --driver-arg=--compile "
        "--driver-arg=--kv-dtype --driver-arg=float16)"
    )
    # Each flag is named until it is given; a float32 KV cache named explicitly is still float32.
    assert hint(weights="w8a8").startswith("faster on this CPU: --compile --kv-dtype float16 (")
    assert hint(weights="w8a8", kv_dtype="float32").startswith("faster on this CPU: --compile --kv-dtype float16 (")
    assert hint(kv_dtype="float16").startswith("faster on this CPU: --weights w8a8 --compile (")
    assert hint(weights="w8a8", kv_dtype="float16").startswith("faster on this CPU: --compile (")
    assert hint(weights="w8a8", compile=True, kv_dtype="float16") == ""
    assert hint(kv_dtype="bfloat16", weights="w8a8").startswith("faster on this CPU: --compile (")
    assert hint(dtype="bfloat16") == ""


@needs_kernel
def test_no_faster_configuration_without_a_vector_int8_kernel(kernel: None, tmp_path: Path) -> None:
    # The portable int8 kernel is correct, not fast: nothing to suggest (an ARM CPU, or the cap).
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    with cpu_kernels.limit_isa("portable"):
        assert TorchDriver(ckpt, DriverOptions(num_pages=8)).faster_configuration() == ""


def test_the_variant_queries_load_the_kernels_or_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    for query in (cpu_kernels.cpu_isas, cpu_kernels.variants, lambda: cpu_kernels.set_isa_cap("avx2")):
        with pytest.raises(RuntimeError, match="C\\+\\+ CPU kernels are not built here"):
            query()
    assert cpu_kernels.describe() == "C++ CPU kernels not built: torch paths"
