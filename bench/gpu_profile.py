"""Where a batch-1 decode step of the torch driver spends its time on a device, for a model of
SmolLM2-135M's shape with random weights (no checkpoint to carry): the step's rate, then Python's
profile (cumulative time per function) and torch's profiler (host time per op, CUDA syncs) over a
few steps. Usage: python bench/gpu_profile.py [--device cuda] [--dtype float32] [--steps 32]
[--graphs] [--out DIR] (writes DIR/gpu_profile.txt with the tables)."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import greedy
from bridge_schema.messages import Hello
from drivers.torch.driver import DriverOptions, TorchDriver
from tests.drivers.torch.helpers import load_dir, write_tiny_llama

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--graphs", action="store_true", help="replay decode passes from CUDA graphs")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    report = io.StringIO()

    def say(text: str) -> None:
        print(text, flush=True)
        report.write(text + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        print("writing a random model of SmolLM2-135M's shape", flush=True)
        ckpt = load_dir(write_tiny_llama(Path(tmp) / "m", **SMOLLM2_SHAPE))
    drv = TorchDriver(ckpt, DriverOptions(device=args.device, dtype=args.dtype, num_pages=16, cuda_graphs=args.graphs))
    drv.handshake(Hello())
    prompt = list(range(1, 33))
    greedy(drv, prompt, 8)  # warm up
    _, rate = greedy(drv, prompt, args.steps)
    say(f"{args.device} {args.dtype}: batch-1 decode {rate:.1f} tok/s ({1000 / rate:.2f} ms a step)")

    prof = cProfile.Profile()
    prof.enable()
    greedy(drv, prompt, args.steps)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    say(f"\nPython profile of {args.steps} steps, by cumulative time:\n{text.getvalue()}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as tp:
        start = time.perf_counter()
        greedy(drv, prompt, args.steps)
        wall = time.perf_counter() - start
    say(f"torch profiler over {args.steps} steps ({wall * 1000:.0f} ms with the profiler on):")
    say(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_profile.txt").write_text(report.getvalue())
    print(f"wrote {args.out / 'gpu_profile.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
