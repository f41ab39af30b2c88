"""The fused decode step (`fused_decode.py`, `decode_step.cpp`): a w8a8 decode pass as one C++ call.

Its matmul code gives the w8a8 op's bits for any range of output columns, at every row count, in
every variant; the step tracks the model's own path on SmolLM2 (the same greedy tokens, logits
within w8a8's rounding) in every variant and with a float16 cache, writes the same K/V; a row's
logits do not depend on its batch or the thread count; only decode passes without adapters take
it, on models it supports; bad inputs are refused with errors that say what was wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bridge_schema.batch import Sampler
from bridge_schema.messages import Adapter, Hello
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.kernels import cpu_kernels
from drivers.torch.runners.fused_decode import W8A8_MAX_ROWS, unsupported, w8a8_max_rows
from drivers.torch.weights.checkpoint import Checkpoint
from drivers.torch.weights.quantize import DynamicInt8Linear
from tests.drivers.torch.helpers import (
    forward,
    load_dir,
    needs_kernel,
    random_tokens,
    request,
    write_adapter,
    write_tiny_gemma,
    write_tiny_llama,
)

pytestmark = needs_kernel


def _packed_linear(n: int, k: int, seed: int) -> DynamicInt8Linear:
    g = torch.Generator().manual_seed(seed)
    lin = DynamicInt8Linear(torch.randn(n, k, generator=g), None, use_kernel=True)
    lin.use_packed(lin.packed_bytes())
    return lin


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13])
def test_columns_give_the_ops_bits(isa: dict[str, str], rows: int) -> None:
    """Any column range [c0, c1) (whole panels, parts of panels, the ragged last one) of any row
    count gives exactly the w8a8 op's values there and writes nothing else."""
    module = cpu_kernels.pass_planner()
    assert module is not None
    n, k = 200, 77  # 4 panels, the last one 8 columns; inputs not a multiple of 4
    lin = _packed_linear(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows))
    x[0, 3] = 40.0  # one outlier channel, as smoothing leaves them
    expected = torch.ops.wafer.w8a8_linear_packed(x, lin.packed, n)
    for c0, c1 in ((0, n), (0, 16), (16, 48), (48, 144), (64, 128), (128, 192), (176, n), (192, n), (32, 32)):
        got = module.w8a8_columns(x, lin.packed, n, c0, c1)
        assert torch.equal(got[:, c0:c1], expected[:, c0:c1]), (isa, rows, c0, c1)
        assert not got[:, :c0].any() and not got[:, c1:].any()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        module.w8a8_columns(x, lin.packed, n, 8, 16)
    with pytest.raises(RuntimeError, match="packed weights hold"):
        module.w8a8_columns(x, lin.packed[:-4], n, 0, n)


def _drivers(ckpt: Checkpoint, kv_dtype: str = "", num_pages: int = 64, weights: str = "w8a8") -> Iterator[TorchDriver]:
    """A driver with the fused step, then one without (the model's eager path)."""
    for fused in (True, False):
        drv = TorchDriver(
            ckpt, DriverOptions(weights=weights, num_pages=num_pages, kv_dtype=kv_dtype, fused_decode=fused)
        )
        drv.handshake(Hello())
        yield drv


def _decode(
    drv: TorchDriver, prompt: list[int], steps: int, given: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt`, then `steps` decode passes, each fed the token before it: its own greedy
    choice, or `given`'s (teacher forcing). The greedy tokens and each pass's logits."""
    ps = 16
    pages = list(range(8))
    logits = drv.logits(forward([request(prompt, 0, pages, ps)]))
    tokens, seen = [int(logits[0].argmax())], []
    for i in range(steps):
        fed = tokens[-1] if given is None else given[i]
        logits = drv.logits(forward([request([fed], len(prompt) + i, pages, ps)]))
        seen.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    return tokens, torch.stack(seen)


@pytest.mark.parametrize("kv_dtype", ["", "float16"])
def test_the_step_tracks_the_model_path(smollm2: Checkpoint, isa: dict[str, str], kv_dtype: str) -> None:
    """SmolLM2 decoding 24 tokens (keys past one page), both fed the model path's greedy tokens:
    the same choice wherever the model path's top two logits are 0.5 apart, and logits within
    w8a8's rounding at every step. An int8 code of a layer's activations that rounds the other way
    (float32 rounding in a norm decides it) moves the later layers' K/V by up to ~5% and logits by
    up to ~2.6 of a range of ~30 (correlation >= 0.989, median ~0.995), as between the model's
    eager and compiled paths; with the keys not written, from the second step on the logits
    correlate at 0.6-0.9, differ by up to 22 and pick other tokens."""
    fused, plain = _drivers(smollm2, kv_dtype)
    assert fused.fused is not None and plain.fused is None
    prompt = smollm2.tokenizer.encode("Counting: 1, 2, 3, 4, 5,").ids
    expected, expected_logits = _decode(plain, prompt, 24)
    tokens, logits = _decode(fused, prompt, 24, given=expected)
    assert fused.fused.passes == 24  # decode passes only: the prefill ran the model
    top2 = expected_logits.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert clear.sum() >= 16
    assert torch.equal(torch.tensor(tokens[1:])[clear], torch.tensor(expected[1:])[clear])
    pairs = zip(logits, expected_logits, strict=True)
    correlations = torch.tensor([torch.corrcoef(torch.stack(pair))[0, 1] for pair in pairs])
    assert correlations.min() > 0.98 and correlations.median() > 0.99, correlations
    assert (logits - expected_logits).abs().max() < 4.0
    # the K/V each wrote (the prompt's by the model, the decoded tokens' by the step)
    used = len(prompt) + 24
    for cache_f, cache_p in ((fused.cache.k, plain.cache.k), (fused.cache.v, plain.cache.v)):  # type: ignore[union-attr]
        a, b = cache_f[:, :used].float(), cache_p[:, :used].float()
        assert torch.equal(a[:, : len(prompt)], b[:, : len(prompt)])
        assert (a - b).abs().max() < 0.1 * b.abs().max()
        assert not cache_f[:, used:].any()  # nothing written past the tokens


@pytest.mark.parametrize("kv_dtype", ["", "float16"])
def test_the_float32_step_tracks_the_model_path(smollm2: Checkpoint, isa: dict[str, str], kv_dtype: str) -> None:
    """Dense float32 (`make run`'s default): the same matmul bits as the model's path (the same
    op's items and order), norms and SiLU rounded their own way: the same greedy tokens and logits
    within float32 rounding (no int8 codes to amplify it; a float16 cache rounds some K/V the other
    way: up to ~0.01 of logits ~30 apart)."""
    fused, plain = _drivers(smollm2, kv_dtype, weights="dense")
    assert fused.fused is not None and plain.fused is None
    most = int(torch.ops.wafer.f32_linear_max_rows())  # its product's rows
    assert fused.fused.max_rows == most and fused.health()["decode_step"].startswith("fused (float32 ")
    prompt = smollm2.tokenizer.encode("The capital of France is").ids
    expected, expected_logits = _decode(plain, prompt, 24)
    tokens, logits = _decode(fused, prompt, 24)
    assert fused.fused.passes == 24
    assert tokens == expected
    assert (logits - expected_logits).abs().max() < (2e-3 if kv_dtype == "" else 3e-2)
    used = len(prompt) + 24
    for cache_f, cache_p in ((fused.cache.k, plain.cache.k), (fused.cache.v, plain.cache.v)):  # type: ignore[union-attr]
        torch.testing.assert_close(cache_f[:, :used].float(), cache_p[:, :used].float(), atol=1e-2, rtol=2e-3)
        assert not cache_f[:, used:].any()


@pytest.mark.parametrize("weights", ["w8a8", "dense"])
def test_a_row_does_not_depend_on_its_batch_or_the_threads(tmp_path: Path, weights: str) -> None:
    # Every row of a 10-row pass (of the step's 128 w8a8 rows or 24 float32: in float32's product
    # a group of 8 rows and one of 2) alone, then the pass, 3 rows and 2 on 1-3 threads, with
    # the rows' own work done by every thread or shared out between them.
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    drv = next(_drivers(ckpt, num_pages=40, weights=weights))
    assert drv.fused is not None
    ps = 16
    lengths = (9, 17, 40, 5, 12, 21, 3, 30, 8, 14)[: min(10, drv.fused.max_rows)]
    prompts = [random_tokens(n, 96, seed=n) for n in lengths]
    for i, p in enumerate(prompts):
        drv.logits(forward([request(p, 0, range(4 * i, 4 * i + 4), ps, context_id=i)]))

    def step(which: list[int], wanted: set[int] | None = None) -> torch.Tensor:
        # the logits of `wanted`'s rows only (others no output), or all
        specs = [
            request(
                [5 + i], len(prompts[i]), range(4 * i, 4 * i + 4), ps, context_id=i,
                outputs=None if wanted is None or i in wanted else [],
            )
            for i in which
        ]
        return drv.logits(forward(specs))

    everyone = list(range(len(prompts)))
    batched = step(everyone)
    assert drv.fused.passes == 1
    for i in everyone:  # each alone (rewriting its own slot with the same K/V)
        assert torch.equal(step([i])[0], batched[i]), i
    threads = torch.get_num_threads()
    try:
        # the rows' own work done by every thread (split from 1000 rows on) or shared out (from 1)
        last = [len(everyone) - 2, len(everyone) - 1]
        for split in (1000, 1, 2):
            drv.fused.set_split_rows(split)
            assert torch.equal(step(everyone), batched), split
            # output rows made by another thread's share of the rows
            assert torch.equal(step(everyone, wanted=set(last)), batched[last]), split
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                assert torch.equal(step([0, 1, 2]), batched[:3]), (split, n)
                assert torch.equal(step(last), batched[last]), (split, n)
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("weights", ["w8a8", "dense"])
def test_only_decode_passes_without_adapters_take_it(tmp_path: Path, weights: str) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    drv = next(_drivers(ckpt, num_pages=W8A8_MAX_ROWS + 8, weights=weights))
    f32_rows = int(torch.ops.wafer.f32_linear_max_rows())
    packed = [m for m in drv.model.modules() if isinstance(m, DynamicInt8Linear)]
    assert drv.fused is not None and drv.fused.max_rows == (w8a8_max_rows(packed) if packed else f32_rows)
    most = drv.fused.max_rows
    drv.forward(forward([request(random_tokens(6, 96, seed=1), 0, range(4), 16)]))  # a prefill
    drv.forward(forward([request([3, 4], 6, range(4), 16)]))  # two tokens of one request
    assert drv.fused.passes == 0
    drv.forward(forward([request([3], 8, range(4), 16, sampler=Sampler(temperature=0.7, seed=3))]))
    assert drv.fused.passes == 1
    many = [request([1], 0, [4 + i], 16, context_id=1 + i) for i in range(most + 1)]
    drv.forward(forward(many[:most]))
    assert drv.fused.passes == 2
    drv.forward(forward(many))  # more rows than it takes
    assert drv.fused.passes == 2
    write_adapter(tmp_path / "a", ckpt, seed=1)
    drv.adapter(Adapter(op="load", adapter_id=1, path=str(tmp_path / "a")))
    drv.forward(forward([request([3], 9, range(4), 16, adapter_id=1)]))  # LoRA: the model's path
    assert drv.fused.passes == 2
    drv.forward(forward([request([3], 9, range(4), 16)]))
    assert drv.fused.passes == 3
    assert drv.health()["decode_step"].startswith("fused")


def test_the_portable_w8a8_step_stops_where_the_model_path_turns_to_float32(tmp_path: Path) -> None:
    # The portable variant's rows stop below the first row count from which the model's path
    # multiplies some linear in float32 (faster there than the portable integer loop); the
    # vector variants take W8A8_MAX_ROWS whatever those counts.
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    drv = next(_drivers(ckpt, num_pages=8))
    linears = [m for m in drv.model.modules() if isinstance(m, DynamicInt8Linear)]
    assert len(linears) == 4 * ckpt.cfg.num_layers + 1
    for lin in linears:
        lin.sgemm_from_rows = 0
    linears[1].sgemm_from_rows, linears[-1].sgemm_from_rows = 256, 64
    with cpu_kernels.limit_isa("portable"):
        assert w8a8_max_rows(linears) == 63
        linears[-1].sgemm_from_rows = 0
        assert w8a8_max_rows(linears) == W8A8_MAX_ROWS  # 255 rows: more than measured
        linears[1].sgemm_from_rows = 9
        assert w8a8_max_rows(linears) == 8
    if "avx2" in cpu_kernels.cpu_isas():
        with cpu_kernels.limit_isa("avx2"):
            assert w8a8_max_rows(linears) == W8A8_MAX_ROWS


def test_models_it_does_not_take_keep_their_path(tmp_path: Path) -> None:
    gemma = load_dir(write_tiny_gemma(tmp_path / "g", sliding_window=4))
    drv = TorchDriver(gemma, DriverOptions(weights="w8a8", num_pages=8))
    drv.handshake(Hello())
    assert drv.fused is None and drv.cache is not None
    assert unsupported(drv.model, drv.cache) == "gemma blocks"
    assert drv.health()["decode_step"] == "model"
    llama = load_dir(write_tiny_llama(tmp_path / "m"))
    for options in (
        DriverOptions(f32_kernel=False),
        DriverOptions(dtype="bfloat16"),
        DriverOptions(weights="w8a8", w8a8_kernel=False),
        DriverOptions(weights="w8a8", fused_decode=False),
        DriverOptions(fused_decode=False),
    ):
        drv = TorchDriver(llama, options)
        drv.handshake(Hello())
        assert drv.fused is None, options


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    drv = next(_drivers(ckpt, num_pages=8))
    assert drv.fused is not None and drv.cache is not None
    step = drv.fused._step
    cfg = ckpt.cfg
    one = torch.zeros(1, dtype=torch.long)
    keys, mask, empty = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), one.bool()
    assert step.step(one, one, one, keys, mask, empty, one).shape == (1, cfg.vocab_size)
    big = torch.tensor([10_000])
    with pytest.raises(RuntimeError, match="slots: 10000 outside the cache"):
        step.step(one, one, big, keys, mask, empty, one)
    with pytest.raises(RuntimeError, match="key_index: slot 10000"):
        step.step(one, one, one, keys + 10_000, mask, empty, one)
    with pytest.raises(RuntimeError, match="rows: 3 is not a row"):
        step.step(one, one, one, keys, mask, empty, torch.tensor([3]))
    with pytest.raises(RuntimeError, match="tokens: 10000 outside the vocabulary"):
        step.step(big, one, one, keys, mask, empty, one)
    with pytest.raises(RuntimeError, match="positions: int64"):
        step.step(one, one.float(), one, keys, mask, empty, one)
    module = cpu_kernels.pass_planner()
    assert module is not None
    cache = drv.cache
    with pytest.raises(RuntimeError, match="weights: 4 per layer"):
        module.DecodeStep(
            cache.k, cache.k, [], [], [], cache.k, cache.v, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1e-5, 1.0
        )
    # the driver still decodes afterwards
    drv.forward(forward([request([1, 2, 3], 0, range(1), 16)]))
    drv.forward(forward([request([4], 3, range(1), 16)]))
    assert drv.fused.passes == 1
