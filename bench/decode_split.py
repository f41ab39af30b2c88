"""Where a batch-1 decode step of the torch driver goes: the step cut into its host-side pieces
(plan, attention layouts, the attention families' keys, the compiled stack with the embedding,
sampling), medians over the steps, next to the int8 matmuls alone (every `DynamicInt8Linear` of
the model called once, as one step calls them, from C++: bench/cpp/w8a8_sequence.cpp, built on
first use; one such sequence after each step, so that both see the machine in the same state) and
the read bandwidth probe: the matmuls' GB/s against the probe says how close the
kernel streams to the memory, and the step minus the matmuls what the rest costs. It also times
the step's sampling once more at once: the first call runs on caches the weights just flushed.

    python bench/decode_split.py [--dtype float32+w8a8+compile] [--threads 2] [--steps 48] [--out F]

The pieces are the calls `TorchDriver.forward` makes for a decode pass, made one by one here with
a clock between them (`CompiledModel.__call__`'s decode branch, unrolled). Needs a `+compile`
entry with `+w8a8` (the C++ kernel path). Not part of the test run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import (
    _request,
    bench_ours,
    capped,
    cpu_description,
    make_driver,
    read_bandwidth_gbs,
    torch_cap_note,
)

from bridge_schema.batch import build_forward
from drivers.torch.driver import TorchDriver
from drivers.torch.kernels import cpu_kernels
from drivers.torch.kernels.paged_attention import PagedAttention
from drivers.torch.weights.checkpoint import load_checkpoint
from drivers.torch.weights.quantize import DynamicInt8Linear

PROMPT = 64


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Clock:
    """Milliseconds between ticks, kept per piece name."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.start = self.last = time.perf_counter()

    def restart(self) -> None:
        self.start = self.last = time.perf_counter()

    def tick(self, name: str) -> None:
        now = time.perf_counter()
        self.times.setdefault(name, []).append((now - self.last) * 1000)
        self.last = now


def step_pieces(
    drv: TorchDriver, steps: int, between: Callable[[], None]
) -> tuple[dict[str, list[float]], list[float]]:
    """Decode `steps` tokens after a PROMPT-token prefill, timing each piece of every step (ms);
    and the same sampling once more right after each step's, with the caches warm (ms). Calls
    `between` after each step, outside the clock."""
    assert drv.compiled is not None and drv.cache is not None, "needs a +compile entry"
    cm, cfg = drv.compiled, drv.cfg
    pages = (PROMPT + steps + 15) // 16
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, PROMPT).tolist()
    last = int(drv.forward(build_forward(0, [_request(0, prompt, 0, 16, pages)])).tokens[0])
    clock, warm = _Clock(), []
    with torch.inference_mode():
        for s in range(steps):
            req = build_forward(s + 1, [_request(0, [last], PROMPT + s, 16, pages)])
            clock.restart()
            plan, _ = drv.plan_pass(req)
            clock.tick("plan")
            attention = PagedAttention(
                cfg, drv.cache, plan, drv.use_triton, for_compiled=True, kernel=drv.attention_kernel
            )
            clock.tick("attention layouts")
            for window in {cfg.window(i) for i in range(cfg.num_layers)}:
                attention.family_keys(window)  # made once a pass, kept for the stack's call
            clock.tick("family keys")
            logits = cm.decode_stack(plan.tokens, plan.positions, attention)
            clock.tick("compiled stack")
            last = int(drv.sample_pass(req, plan, logits, clock.start).tokens[0])
            clock.tick("sample")
            clock.times.setdefault("step", []).append((clock.last - clock.start) * 1000)
            start = time.perf_counter()
            drv.sample_pass(req, plan, logits, start)
            warm.append((time.perf_counter() - start) * 1000)
            between()
    return clock.times, warm


def _sequence_timer() -> ModuleType:
    """bench/cpp/w8a8_sequence.cpp, built once into torch's extension root (named by its hash)."""
    source = Path(__file__).with_name("cpp") / "w8a8_sequence.cpp"
    name = f"wafer_bench_sequence_{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}"
    log("loading the C++ timing loop for the matmuls (built on first use: ~20 s) ...")
    directory = cpu_kernels.build_directory(name)
    from torch.utils import cpp_extension

    return cpp_extension.load(name, [str(source)], build_directory=str(directory), extra_cflags=["-O2"], verbose=False)


class MatmulSequence:
    """Every int8 linear of the model called once on one row, in the step's order, from C++ (see
    bench/cpp/w8a8_sequence.cpp); each `run()` times one sequence, call by call. It calls the
    three-tensor op on the same bytes the step's packed op reads (`w8a8_linear_packed`, a little
    less work a call), so "the rest" stays comparable with runs before the weights were packed."""

    def __init__(self, drv: TorchDriver) -> None:
        lins = [m for m in drv.model.modules() if isinstance(m, DynamicInt8Linear) and m.use_kernel]
        assert lins, "needs a +w8a8 entry on the C++ kernel"
        self._timer = _sequence_timer()
        self._args = (
            [torch.randn(1, lin.in_features) for lin in lins],
            [lin.weight_int8 for lin in lins],
            [lin.scale for lin in lins],
            [lin.weight_sum for lin in lins],
        )
        self.shapes = [(lin.in_features, lin.scale.numel()) for lin in lins]
        self.bytes = sum(lin.weight_int8.numel() for lin in lins)
        self.seconds: list[torch.Tensor] = []  # one [calls] row a run
        self._timer.time_sequence(*self._args, 2)  # warm up

    def run(self) -> None:
        self.seconds.append(self._timer.time_sequence(*self._args, 1)[0])

    def summary(self, skip: int) -> tuple[float, dict[str, float]]:
        """(median ms of a sequence, median us of a call per shape) over the runs after `skip`.
        Each call is timed where it lies in the step's sequence: called on its own, again and
        again, a weight that fits the last-level cache (the 28 MB head) is read from there."""
        seconds = torch.stack(self.seconds[skip:])
        counts = {shape: self.shapes.count(shape) for shape in self.shapes}
        per_shape = {}
        for k, n in counts:
            columns = [i for i, shape in enumerate(self.shapes) if shape == (k, n)]
            per_shape[f"{k}x{n} (x{counts[(k, n)]})"] = float(seconds[:, columns].median()) * 1e6
        return float((seconds.sum(dim=1) * 1000).median()), per_shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32+w8a8+compile", help="one bench/decode.py --dtype entry")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--out", default="bench/results/decode_split.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    with capped(args.dtype):
        kernels = cpu_kernels.variants() if cpu["kernels"] else {}
    print(
        f"CPU: {cpu['model']}; kernels (under the entry's cap): {kernels}; torch: {cpu['torch_isa']}; "
        f"threads {torch.get_num_threads()}"
    )
    note = torch_cap_note([args.dtype], str(cpu["torch_isa"]))
    if note:
        print(note)
    log("loading SmolLM2 and starting the driver (a first --compile start compiles for minutes) ...")
    ckpt = load_checkpoint("smollm2", show_progress=False)
    with capped(args.dtype):
        drv = make_driver(ckpt, args.dtype, "cpu", (PROMPT + args.steps + 15) // 16 + 8)
        bench_ours(drv, [np.random.default_rng(1).integers(0, 49152, 8).tolist()], 4)  # warm up
        sequence = MatmulSequence(drv)
        log(f"timing {args.steps} decode steps piece by piece, each followed by the int8 matmuls alone ...")
        times, warm = step_pieces(drv, args.steps, sequence.run)
    probe = read_bandwidth_gbs("cpu", repeats=5)
    skip = min(4, args.steps // 4)  # the first steps warm caches and allocators
    matmul_ms, per_shape = sequence.summary(skip)
    matmul_bytes = sequence.bytes
    medians = {name: statistics.median(v[skip:]) for name, v in times.items()}
    step = medians["step"]
    print(f"\n| piece | ms (median of {args.steps - skip} steps) | share of the step |")
    print("|---|---|---|")
    for name, ms in medians.items():
        print(f"| {name} | {ms:.3f} | {ms / step:.0%} |")
    print(
        f"\nint8 matmuls alone: {matmul_ms:.2f} ms a step ({matmul_ms / step:.0%} of the step), "
        f"{matmul_bytes / 1e6:.1f} MB, {matmul_bytes / matmul_ms / 1e6:.1f} GB/s; probe {probe:.1f} GB/s "
        f"(the matmuls at {matmul_bytes / matmul_ms / 1e6 / probe:.0%} of it)"
    )
    print(f"step minus the matmuls: {step - matmul_ms:.2f} ms; decode {1000 / step:.1f} tok/s")
    warm_ms = statistics.median(warm[skip:])
    print(
        f"sampling right after the stack {medians['sample']:.3f} ms, the same call again {warm_ms:.3f} ms: "
        "the step's weights stream through the caches and evict the host's code and data"
    )
    for shape, us in per_shape.items():
        k, n = (int(v) for v in shape.split(" ")[0].split("x"))
        print(f"  {shape}: {us:.1f} us a call, {k * n / us / 1e3:.1f} GB/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "cpu": cpu,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "pieces_ms": medians,
        "sample_again_ms": warm_ms,
        "matmuls_ms": matmul_ms,
        "matmul_bytes": matmul_bytes,
        "matmul_us_per_shape": per_shape,
        "probe_gbs": probe,
        "decode_tok_s": 1000 / step,
    }
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
