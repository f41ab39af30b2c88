"""Tensor parallelism's overhead on the CPU: SmolLM2 served by `python -m drivers.torch
--tensor-parallel N` (N processes, gloo) for each N side by side in one run, driven over the
bridge on a Unix socket: prefill tokens/s (one prompt of --prompt-tokens, median of --repeats)
and decode tokens/s (batch 1, greedy, --new-tokens steps), with each N's ratio to TP 1.

On a CPU the ranks share the same cores and memory bandwidth, so TP N > 1 is not expected to be
faster: this measures what sharding costs (two gloo all-reduces per layer, one broadcast per pass,
N processes on the cores), not a speed-up. `tp_rows` is importable (e.g. by a replicas bench).

    python bench/tensor_parallel.py [--ranks 1,3] [--threads 1] [--prompt-tokens 128]
                                    [--new-tokens 32] [--repeats 3] [--driver-args ARGS] [--out PATH]

Prints a table and writes JSON. Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_name  # bench/, this script's folder

from bridge_schema.batch import OutputSpec, RequestSpec, build_forward
from bridge_schema.client import Client
from bridge_schema.messages import ForwardResult, Hello
from bridge_schema.transport import connect

PAGE_SIZE = 16
STARTUP_TIMEOUT_S = 600.0  # the first start on a machine builds the C++ CPU kernels (a minute or two)
NOTE = "TP overhead on the CPU with gloo (ranks share the cores; not a speed-up)"


def _request(context: int, tokens: list[int], start: int, pages_per: int) -> RequestSpec:
    kv = start + len(tokens)
    pages = list(range(context * pages_per, context * pages_per + -(-kv // PAGE_SIZE)))
    last = kv - (len(pages) - 1) * PAGE_SIZE
    return RequestSpec(context, tokens, list(range(start, kv)), pages, last, [OutputSpec(len(tokens) - 1)])


async def _drive(address: str, prompt_tokens: int, new_tokens: int, repeats: int) -> tuple[float, float, list[int]]:
    """(prefill tok/s median, decode tok/s, the greedy tokens) against the driver at `address`."""
    pages_per = -(-(prompt_tokens + new_tokens) // PAGE_SIZE)
    prompt = [(i * 7919) % 4000 + 100 for i in range(prompt_tokens)]
    async with Client.open(await connect(address)) as client:
        await client.hello(Hello(page_size=PAGE_SIZE, num_pages=pages_per * (repeats + 1)))
        await client.request(build_forward(0, [_request(repeats, prompt[:8], 0, pages_per)]), ForwardResult)  # warm
        prefill = []
        for r in range(repeats):
            t = time.perf_counter()
            res = await client.request(build_forward(r + 1, [_request(r, prompt, 0, pages_per)]), ForwardResult)
            prefill.append(prompt_tokens / (time.perf_counter() - t))
        tokens = [int(res.tokens[0])]
        t = time.perf_counter()
        for s in range(new_tokens):
            fwd = build_forward(100 + s, [_request(0, tokens[-1:], prompt_tokens + s, pages_per)])
            tokens.append(int((await client.request(fwd, ForwardResult)).tokens[0]))
        decode = new_tokens / (time.perf_counter() - t)
    return statistics.median(prefill), decode, tokens


def _serve(num_ranks: int, threads: int, sock: Path, extra: tuple[str, ...]) -> tuple[subprocess.Popen[bytes], float]:
    cmd = [sys.executable, "-m", "drivers.torch", "--model", "smollm2", "--threads", str(threads), *extra]
    cmd += ["--tensor-parallel", str(num_ranks), "--listen", f"unix:{sock}", "--log-level", "WARNING"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
    while not sock.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"TP {num_ranks} driver exited with status {proc.returncode}")
        if time.perf_counter() - start > STARTUP_TIMEOUT_S:
            proc.kill()
            raise RuntimeError(f"TP {num_ranks} driver did not listen within {STARTUP_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    return proc, time.perf_counter() - start


def tp_rows(
    ranks: tuple[int, ...] = (1, 3),
    threads: int = 1,
    prompt_tokens: int = 128,
    new_tokens: int = 32,
    repeats: int = 3,
    driver_args: tuple[str, ...] = (),
    progress: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
) -> list[dict[str, Any]]:
    """One row per rank count: SmolLM2 prefill and decode tokens/s over the bridge, with ratios
    to the first entry (TP 1), and whether its greedy tokens equal the first entry's. `driver_args`
    go to every driver (e.g. `--weights w8a8 --compile`)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in ranks:
            progress(f"TP {n}: starting {n} rank(s) ({threads} thread(s) each)")
            sock = Path(tmp) / f"tp{n}.sock"
            proc, startup_s = _serve(n, threads, sock, driver_args)
            try:
                progress(f"TP {n}: ready in {startup_s:.1f} s; prefill x{repeats}, decode {new_tokens} tokens")
                prefill, decode, tokens = anyio.run(_drive, f"unix:{sock}", prompt_tokens, new_tokens, repeats)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            rows.append(
                {
                    "name": f"torch TP {n} (gloo, CPU){' ' + ' '.join(driver_args) if driver_args else ''}",
                    "driver_args": list(driver_args),
                    "tensor_parallel": n,
                    "backend": "gloo",
                    "threads_per_rank": threads,
                    "prefill_tok_s": prefill,
                    "decode_tok_s": decode,
                    "startup_s": startup_s,
                    "tokens": tokens,
                    "note": NOTE,
                }
            )
            progress(f"TP {n}: prefill {prefill:.0f} tok/s, decode {decode:.1f} tok/s")
    base = rows[0]
    for row in rows:
        row["prefill_vs_tp1"] = row["prefill_tok_s"] / base["prefill_tok_s"]
        row["decode_vs_tp1"] = row["decode_tok_s"] / base["decode_tok_s"]
        row["same_tokens_as_tp1"] = row["tokens"] == base["tokens"]
    return rows


def print_table(rows: list[dict[str, Any]], prompt_tokens: int) -> None:
    """The rows of `tp_rows` as a markdown table, under the note that says what they measure."""
    print(f"{NOTE}:")
    print(
        f"| TP | threads/rank | prefill tok/s ({prompt_tokens}) | vs TP 1 | decode tok/s (B=1) "
        "| vs TP 1 | same greedy tokens | start-up s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "yes" if r["same_tokens_as_tp1"] else "NO"
        print(
            f"| {r['tensor_parallel']} | {r['threads_per_rank']} | {r['prefill_tok_s']:.0f} "
            f"| {r['prefill_vs_tp1']:.2f}x | {r['decode_tok_s']:.1f} | {r['decode_vs_tp1']:.2f}x | {same} "
            f"| {r['startup_s']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,3", help="rank counts, comma-separated; the first is the baseline")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--driver-args", default="", help="arguments for every driver, e.g. '--weights w8a8 --compile'")
    parser.add_argument("--out", default="bench/results/tensor_parallel.json")
    args = parser.parse_args()
    driver_args = tuple(shlex.split(args.driver_args))
    cpu = cpu_name()
    shown = f", driver arguments {' '.join(driver_args)}" if driver_args else ""
    model = f"model SmolLM2-135M-Instruct, float32{shown}, over the bridge"
    print(f"CPU: {cpu} ({os.cpu_count()} cores); {model}", flush=True)
    print(f"{NOTE}", flush=True)
    load_start = os.getloadavg()[0]
    ranks = tuple(int(r) for r in args.ranks.split(","))
    rows = tp_rows(ranks, args.threads, args.prompt_tokens, args.new_tokens, args.repeats, driver_args)
    load_end = os.getloadavg()[0]
    print()
    print(f"load average {load_start:.2f} at the start, {load_end:.2f} at the end")
    print_table(rows, args.prompt_tokens)
    meta = {"cpu": cpu, "cores": os.cpu_count(), "load_start": load_start, "load_end": load_end, "note": NOTE}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
