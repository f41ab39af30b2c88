"""The dense float32 decode matmuls alone: `torch.ops.wafer.f32_linear_t` (`f32_matvec.cpp`) against
torch's `x @ w_t` (MKL) on SmolLM2's products of one decode step (30 layers of q/k/v, o, gate/up
and down over weights kept [in, out], then the 576 x 49,152 output head: 538 MB), at several row
counts (a batch's decode rows). The two run alternately, a whole step each, `--rounds` times;
medians. Prints a table with the weights' GB/s and the ratio, and writes JSON. Rows past
the variant's `f32_linear_max_rows()` (24; portable 4) are torch's matmul in both columns (the op
hands them over).

    python bench/f32_matmul.py [--threads 2] [--rows 1,2,4,8,16,24,32] [--isa best,avx2] [--out F]

Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import cpu_description

from drivers.torch.kernels import cpu_kernels

# SmolLM2-135M: hidden 576, q/k/v fused 960 outputs, gate/up fused 3,072, intermediate 1,536.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def step_seconds(matmul: Matmul, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        matmul(inputs[w.shape[0]], w)
    return time.perf_counter() - start


def measure(weights: list[torch.Tensor], rows: int, rounds: int) -> tuple[float, float]:
    """Median seconds of a step through the op and through torch, alternated."""
    inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
    op: Matmul = torch.ops.wafer.f32_linear_t
    ours, theirs = [], []
    step_seconds(op, weights, inputs)  # warm: first touch of the partial sums
    step_seconds(torch.matmul, weights, inputs)
    for _ in range(rounds):
        ours.append(step_seconds(op, weights, inputs))
        theirs.append(step_seconds(torch.matmul, weights, inputs))
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="default: all cores")
    parser.add_argument("--rows", default="1,2,4,8,16,24,32")
    parser.add_argument("--isa", default="best", help="comma-separated: best, avx512, avx2, portable")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="bench/results/f32_matmul.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        sys.exit("the C++ CPU kernels do not build here (the log says why)")
    cpu = cpu_description()
    log(f"CPU: {cpu['model']}; kernels {cpu['kernels']}; threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(k, n, generator=gen) for k, n in SHAPES]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    results = []
    for isa in args.isa.split(","):
        with cpu_kernels.limit_isa(cpu_kernels.cpu_isas()[-1] if isa == "best" else isa) as variants:
            most = int(torch.ops.wafer.f32_linear_max_rows())  # the variant's
            for rows in (int(r) for r in args.rows.split(",")):
                log(f"{variants['f32_linear']}: {rows} rows, {args.rounds} rounds")
                ours, theirs = measure(weights, rows, args.rounds)
                results.append(
                    {
                        "variant": variants["f32_linear"],
                        "rows": rows,
                        "op_ms": ours * 1e3,
                        "torch_ms": theirs * 1e3,
                        "op_gbs": nbytes / ours / 1e9,
                        "torch_gbs": nbytes / theirs / 1e9,
                        "speedup": theirs / ours,
                        "op_runs": rows <= most,
                    }
                )
    print(f"\nCPU: {cpu['model']} ({' '.join(cpu['features'])}); {torch.get_num_threads()} threads")  # type: ignore[arg-type]
    print(f"SmolLM2's float32 decode products, {nbytes / 1e6:.0f} MB of weights a step, medians of {args.rounds}\n")
    print("| variant | rows | op ms | op GB/s | torch ms | torch GB/s | torch / op |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        note = "" if r["op_runs"] else " (torch's)"
        print(
            f"| {r['variant']} | {r['rows']}{note} | {r['op_ms']:.1f} | {r['op_gbs']:.1f} | {r['torch_ms']:.1f} "
            f"| {r['torch_gbs']:.1f} | {r['speedup']:.2f}x |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "threads": torch.get_num_threads(), "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
