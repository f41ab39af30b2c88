"""Sampler chains: decode tokens/s on SmolLM2 (the torch driver) at batch 1 and 8, greedy against
a six-stage chain (logit bias, penalties, temperature, top-k, top-p, min-p) run by the driver and
the same chain written as a guest loop over each step's top 20 tokens, side by side in one run,
with a plain `Random` sampler (the chain's last four stages) for reference.
Batch B is B concurrent runs of `bench/inferlets/sampling_chain`, one context each; the modes
alternate within each round, medians over the rounds.

    python bench/sampling.py [--tokens 64] [--rounds 3] [--batches 1,8] [--out bench/results/sampling.json]

Prints a table and writes JSON rows with `where` ("driver", "guest", or "" for greedy) and
`ratio_vs_greedy`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name
from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox.config import SandboxConfig, default_cache_dir
from host.sandbox.sandbox import Sandbox

MODES = ("greedy", "random", "driver", "guest")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(sandbox: Sandbox, component: Any, engine: Engine, mode: str, batch: int, tokens: int) -> float:
    """Tokens/s of `batch` concurrent runs decoding `tokens` each."""
    t0 = time.perf_counter()
    handles = [
        sandbox.start(component, engine, ["--mode", mode, "--tokens", str(tokens), "--seed", str(i + 1)])
        for i in range(batch)
    ]
    outcomes = [h.wait() for h in handles]
    wall = time.perf_counter() - t0
    assert all(o.is_ok for o in outcomes), [o.error for o in outcomes if not o.is_ok]
    return batch * tokens / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--driver-arg", action="append", default=[], help="an argument for the torch driver")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--out", default="bench/results/sampling.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    log("building bench/inferlets/sampling_chain ...")
    wasm = build(str(Path(__file__).parent / "inferlets" / "sampling_chain"), args.cache_dir, log).wasm_path
    speeds: dict[tuple[int, str], list[float]] = {}
    config = EngineConfig("torch", args.driver_arg, speculation_depth=1, startup_timeout_s=900)
    with Sandbox(SandboxConfig(cache_dir=args.cache_dir)) as sandbox, Engine.start(config) as engine:
        component = sandbox.load(wasm)
        measure(sandbox, component, engine, "driver", 1, 8)  # warm-up: first passes, caches
        for round_ in range(args.rounds):
            for batch in batches:
                for mode in MODES:
                    speed = measure(sandbox, component, engine, mode, batch, args.tokens)
                    speeds.setdefault((batch, mode), []).append(speed)
                    log(f"round {round_ + 1}: batch {batch}, {mode}: {speed:.1f} tok/s")
    rows = []
    for batch in batches:
        greedy = statistics.median(speeds[(batch, "greedy")])
        for mode in MODES:
            speed = statistics.median(speeds[(batch, mode)])
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "where": mode if mode in ("driver", "guest") else "",
                    "tokens_per_s": round(speed, 2),
                    "ratio_vs_greedy": round(speed / greedy, 3),
                    "rounds": [round(s, 2) for s in speeds[(batch, mode)]],
                }
            )
    print(f"{'batch':>5} {'sampler':<22} {'tok/s':>8} {'vs greedy':>9}")
    names = {
        "greedy": "greedy",
        "random": "Random (4 stages)",
        "driver": "6-stage chain, driver",
        "guest": "6-stage chain, guest",
    }
    for r in rows:
        print(f"{r['batch']:>5} {names[r['mode']]:<22} {r['tokens_per_s']:>8.1f} {r['ratio_vs_greedy']:>9.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), "tokens": args.tokens, "driver_args": args.driver_arg}
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
