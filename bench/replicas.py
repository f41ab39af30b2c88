"""Driver replicas: aggregate tokens/s of 64 concurrent text_completion runs (real inferlets in the
real sandbox, generating on the host) on 1, 2 and 4 dummy driver replicas, each a process that
simulates a device with a fixed time per pass (`--pass-latency-ms`, 5 by default), side by side.

The dummy's pass time does not grow with the batch, so the device is the bottleneck only while a
pass is shorter than the host's work for it: `--max-requests-per-pass` (the simulated device's
batch, passed to every driver) and `--max-decode-steps` (1: one token per pass, as a device
decodes; more lets one 5 ms pass carry many steps and makes the host the bottleneck) set that.
Every replica's driver and the host share this machine's cores: on a small machine the host's
own CPU, not the replicas, bounds the larger configurations (the table shows host CPU per token).

    python bench/replicas.py [--rounds 5] [--out bench/results/replicas.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import tensor_parallel  # bench/, this script's folder
from host_overhead import run_all
from machine import cpu_name

from host.build import build
from host.engine import EngineConfig, ReplicatedEngine
from host.sandbox.config import SandboxConfig, default_cache_dir
from host.sandbox.sandbox import Sandbox

TARGETS = {2: 1.8, 4: 3.2}  # replicas -> aggregate tokens/s at least this many times one replica's


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(sandbox: Sandbox, engine: ReplicatedEngine, component: Any, runs: int, tokens: int) -> dict[str, float]:
    outputs_before = engine.driver_health().get("outputs", 0)
    passes_before = engine.timing_stats()["passes"]
    handles, cpu, wall = run_all(sandbox, engine, component, runs, tokens, [])
    generated = float(engine.driver_health().get("outputs", 0)) - float(outputs_before)
    passes = engine.timing_stats()["passes"] - passes_before
    placed = [engine.placement(h.run_id) for h in handles]
    per_replica = [sum(1 for p in placed if p is not None and p[0] == i) for i in range(engine.num_replicas)]
    return {
        "tokens": generated,
        "tokens_per_s": generated / wall,
        "host_us_per_token": cpu / generated * 1e6,
        "wall_s": wall,
        "tokens_per_pass": generated / max(passes, 1.0),
        "runs_per_replica": per_replica,  # type: ignore[dict-item]
    }


def _median_row(
    batch: int, n: int, runs: int, found: list[dict[str, Any]], one: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One table row: the median of each measure over the rounds, and each round's ratio to the
    same round's one-replica row (`speedups`; `speedup` their median)."""
    row: dict[str, Any] = {"batch": batch, "replicas": n, "runs": runs, "samples": found}
    for key in ("tokens", "tokens_per_s", "host_us_per_token", "wall_s", "tokens_per_pass"):
        row[key] = statistics.median(m[key] for m in found)
    row["runs_per_replica"] = found[-1]["runs_per_replica"]
    speedups = [m["tokens_per_s"] / b["tokens_per_s"] for m, b in zip(found, one or [], strict=False)]
    row["speedups"] = speedups
    row["speedup"] = statistics.median(speedups) if speedups else 0.0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/replicas.json")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--replicas", default="1,2,4", help="replica counts, comma-separated")
    parser.add_argument(
        "--tensor-parallel",
        default="1,3",
        help="also SmolLM2 on the torch driver at these rank counts (gloo, CPU: the overhead); '' skips",
    )
    parser.add_argument("--runs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200, help="tokens each run generates")
    parser.add_argument("--pass-latency-ms", type=float, default=5.0)
    parser.add_argument(
        "--batches", default="256,8", help="the simulated device's batch (--max-requests-per-pass), comma-separated"
    )
    parser.add_argument("--max-decode-steps", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every row this many times; the table shows medians"
    )
    args = parser.parse_args()
    counts = [int(n) for n in args.replicas.split(",")]
    batches = [int(n) for n in args.batches.split(",")]
    log("building text_completion (cached after the first time) ...")
    text = build("text_completion", args.cache_dir, log)
    samples: dict[tuple[int, int], list[dict[str, Any]]] = {}
    with Sandbox(SandboxConfig(cache_dir=args.cache_dir)) as sandbox:
        component = sandbox.load(text.wasm_path)
        for round_ in range(args.rounds):
            for batch in batches:
                driver_args = ("--num-pages", "16384", "--pass-latency-ms", str(args.pass_latency_ms))
                driver_args += ("--max-requests-per-pass", str(batch))
                config = EngineConfig("dummy", driver_args, speculation_depth=1, max_decode_steps=args.max_decode_steps)
                for n in counts:
                    log(f"round {round_ + 1}/{args.rounds}, batch {batch}, {n} replica(s): starting the drivers ...")
                    with ReplicatedEngine.start([config] * n) as engine:
                        measure(sandbox, engine, component, 8, 20)  # warm-up
                        log(f"batch {batch}, {n} replica(s): {args.runs} runs x {args.tokens} tokens ...")
                        samples.setdefault((batch, n), []).append(
                            measure(sandbox, engine, component, args.runs, args.tokens)
                        )
    rows = [_median_row(batch, n, args.runs, found, samples.get((batch, 1))) for (batch, n), found in samples.items()]
    ranks = tuple(int(r) for r in args.tensor_parallel.split(",") if r)
    tp = tensor_parallel.tp_rows(ranks) if ranks else []
    print(
        f"CPU: {cpu_name()} ({os.cpu_count()} cores, shared by the host and every driver); dummy pass latency "
        f"{args.pass_latency_ms:g} ms; max decode steps {args.max_decode_steps}; medians of {args.rounds} round(s)"
    )
    header = (
        f"{'batch':>5} {'replicas':>8} {'runs':>4} {'tokens':>6} {'tok/s':>7} {'x one':>6} {'x one seen':>11} "
        f"{'tok/pass':>8} {'host us/tok':>11} {'runs per replica':>18}"
    )
    print(header)
    print("-" * len(header))
    targets = {}
    for r in rows:
        spread = "/".join(str(k) for k in r.get("runs_per_replica", []))
        seen = f"{min(r['speedups']):.2f}-{max(r['speedups']):.2f}" if r["speedups"] else "-"
        print(
            f"{r['batch']:>5} {r['replicas']:>8} {r['runs']:>4} {r['tokens']:>6.0f} "
            f"{r['tokens_per_s']:>7.0f} {r['speedup']:>6.2f} {seen:>11} {r['tokens_per_pass']:>8.1f} "
            f"{r['host_us_per_token']:>11.0f} {spread:>18}"
        )
        if r["replicas"] in TARGETS and r["speedups"]:
            factor = TARGETS[r["replicas"]]
            targets[f"batch {r['batch']}: {r['replicas']} replicas at least {factor}x one (median)"] = (
                r["speedup"] >= factor
            )
    for target, met in targets.items():
        print(f"target: {target}: {'met' if met else 'NOT met'}")
    if tp:
        print()
        tensor_parallel.print_table(tp, 128)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": cpu_name(), "cores": os.cpu_count()}
    out.write_text(
        json.dumps(
            {
                "machine": machine,
                "args": vars(args) | {"cache_dir": str(args.cache_dir)},
                "rows": rows,
                "targets": targets,
                "tensor_parallel": tp,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
