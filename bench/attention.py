"""The C++ decode attention (`torch.ops.wafer.decode_attention`) alone, as a decode step calls it:
one query per request, SmolLM2's shapes (9 heads, 3 KV heads, head size 64), each of 30 layers
with its own cache, next to the torch path it replaces (`paged_attention._decode_attention`, the
gather and reductions). Two states of the caches:

- cold: before each layer's call a weight-sized stream (140 MB over the 30 layers, as a step's
  int8 weights) is read, so that the layer's K/V come from memory, as in a decode step;
- warm: the layers called one after another with nothing between (K/V from the caches as far as
  they fit).

and two layouts of a request's pages: contiguous (a fresh server) or scattered (pages freed and
reused by other requests). Each call is timed alone; medians. Prints a table, the K/V bytes a call
reads and what they come to per second, and writes JSON.

    python bench/attention.py [--threads 2] [--keys 64,256,1024,2048] [--rounds 8] [--out F]

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
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import cpu_description

from drivers.torch.kernels import cpu_kernels
from drivers.torch.kernels.paged_attention import LayerKeys, _decode_attention

HEADS, KV_HEADS, DIM, LAYERS, PAGE = 9, 3, 64, 30, 16
SLOTS = 8192
STREAM_BYTES = 140_000_000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def key_index(n: int, scattered: bool) -> torch.Tensor:
    """The cache slots of a request's n keys, page by page: pages 3, 4, ... or a fixed random draw."""
    pages = (n + PAGE - 1) // PAGE
    if scattered:
        ids = torch.randperm(SLOTS // PAGE, generator=torch.Generator().manual_seed(n))[:pages]
    else:
        ids = torch.arange(pages) + 3
    return (ids[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n][None].contiguous()


def time_calls(call: Callable[[int], object], chunks: list[torch.Tensor] | None, rounds: int) -> float:
    """Median microseconds of call(layer) over rounds x LAYERS calls (the first round dropped)."""
    times = []
    for _ in range(rounds + 1):
        for layer in range(LAYERS):
            if chunks is not None:
                chunks[layer].sum()
            t = time.perf_counter()
            call(layer)
            times.append(time.perf_counter() - t)
    return statistics.median(times[LAYERS:]) * 1e6


def measure(
    ks: list[torch.Tensor], vs: list[torch.Tensor], q: torch.Tensor, n: int, scattered: bool,
    chunks: list[torch.Tensor], rounds: int,
) -> dict[str, Any]:
    """One row: the op and the torch path over n keys, cold and warm (checked equal first)."""
    index = key_index(n, scattered)
    mask, empty = torch.ones(1, n, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)
    zero = torch.zeros(1, 1, dtype=torch.long)

    def ours(layer: int) -> torch.Tensor:
        return torch.ops.wafer.decode_attention(q, ks[layer], vs[layer], index, mask, empty, 0.125)

    def torch_path(layer: int) -> torch.Tensor:
        keys = LayerKeys(ks[layer], vs[layer], zero[0], zero, index, mask[:, None], empty[:, None], zero[0])
        return _decode_attention(q, keys, 0.125)

    torch.testing.assert_close(ours(0), torch_path(0)[:, 0], rtol=1e-4, atol=1e-5)
    row: dict[str, Any] = {
        "kv_dtype": str(ks[0].dtype).removeprefix("torch."),
        "keys": n,
        "pages": "scattered" if scattered else "contiguous",
        "kv_bytes": 2 * n * KV_HEADS * DIM * ks[0].element_size(),
    }
    for name, call in (("ours", ours), ("torch", torch_path)):
        row[f"{name}_cold_us"] = time_calls(call, chunks, rounds)
        row[f"{name}_warm_us"] = time_calls(call, None, rounds)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keys", default="64,256,1024,2048")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default="bench/results/attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load(show_progress=True):
        raise SystemExit("the C++ kernels did not build on this machine: nothing to measure")
    cpu = cpu_description()
    log(f"CPU: {cpu['model']}; kernels: {cpu['kernels']}; {args.threads} threads")
    chunks = list(torch.ones(STREAM_BYTES // 4).chunk(LAYERS))
    rows = []
    for dtype in (torch.float32, torch.float16):
        gen = torch.Generator().manual_seed(0)
        ks = [torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
        vs = [torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
        q = torch.randn(1, HEADS, DIM, generator=gen)
        for n in [int(k) for k in args.keys.split(",")]:
            for scattered in (False, True):
                row = measure(ks, vs, q, n, scattered, chunks, args.rounds)
                rows.append(row)
                log(f"{row['kv_dtype']} {n} keys {row['pages']}: cold {row['ours_cold_us']:.1f} us")
    print(f"CPU: {cpu['model']}; kernels: {cpu['kernels']}; {args.threads} threads")
    print(
        "| K/V | keys | pages | K/V bytes | cold us | cold GB/s | warm us | torch cold us | torch warm us "
        "| cold vs torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kv_dtype']} | {r['keys']} | {r['pages']} | {r['kv_bytes'] / 1e3:.0f} KB | "
            f"{r['ours_cold_us']:.1f} | "
            f"{r['kv_bytes'] / r['ours_cold_us'] / 1e3:.1f} | {r['ours_warm_us']:.1f} | {r['torch_cold_us']:.1f} | "
            f"{r['torch_warm_us']:.1f} | {r['torch_cold_us'] / r['ours_cold_us']:.2f}x |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "threads": args.threads, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
