"""Pass-level speculation: tokens/s with the dummy driver simulating a pass latency L (2, 5 and
10 ms) and an inferlet that works 1 ms per token, at speculation depth 0, 1 and 2, for 1 and 8
concurrent runs, side by side, with the hit rate. With speculation the next pass is already in
flight while the inferlet works, so one run approaches 1/L tokens/s.

    python bench/speculation.py [--out bench/results/speculation.json]
    python bench/speculation.py --latencies 5 --depths 1 --runs 8 --rounds 9   # one row, median of 9

The script runs on the engine before `EngineConfig` too (`Engine.start` with keywords), so
`bench/compare.py --same-script` can put one row of it side by side with an older revision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from host.build import build
from host.engine import Engine
from host.sandbox.config import SandboxConfig, default_cache_dir
from host.sandbox.sandbox import Sandbox

LATENCIES_MS = (2, 5, 10)
DEPTHS = (0, 1, 2)
RUNS = (1, 8)
TOKENS = 200
WORK_US = 1000


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def numbers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def start_engine(latency: int, depth: int) -> Any:
    driver_args = ["--pass-latency-ms", str(latency)]
    try:
        from host.engine import EngineConfig
    except ImportError:  # a revision before EngineConfig
        return Engine.start("dummy", driver_args, speculation_depth=depth)
    return Engine.start(EngineConfig("dummy", driver_args, speculation_depth=depth))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/speculation.json")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--latencies", type=numbers, default=LATENCIES_MS, help="pass latencies in ms (2,5,10)")
    parser.add_argument("--depths", type=numbers, default=DEPTHS, help="speculation depths (0,1,2)")
    parser.add_argument("--runs", type=numbers, default=RUNS, help="concurrent runs (1,8)")
    parser.add_argument("--rounds", type=int, default=1, help="measure each row this many times; report medians")
    args = parser.parse_args()
    log("building bench/inferlets/busy_decode ...")
    wasm = build(str(Path(__file__).parent / "inferlets" / "busy_decode"), args.cache_dir, log).wasm_path
    rows = []
    with Sandbox(SandboxConfig(cache_dir=args.cache_dir)) as sandbox:
        component = sandbox.load(wasm)
        for latency in args.latencies:
            for depth in args.depths:
                with start_engine(latency, depth) as engine:
                    for runs in args.runs:
                        log(f"L={latency} ms, depth {depth}, {runs} run(s) ...")
                        rounds = [measure(sandbox, component, engine, runs) for _ in range(args.rounds)]
                        wall = statistics.median(r[0] for r in rounds)
                        hits = statistics.median(r[1] for r in rounds)
                        decode_steps = runs * (TOKENS - 1)  # the first step follows the prefill
                        rows.append(
                            {
                                "latency_ms": latency,
                                "depth": depth,
                                "runs": runs,
                                "per_run_tokens_per_s": TOKENS / wall,
                                "aggregate_tokens_per_s": runs * TOKENS / wall,
                                "ideal_tokens_per_s": 1000 / latency,
                                "hit_rate": hits / decode_steps,
                                "rounds": args.rounds,
                            }
                        )
    depths = args.depths
    header = f"{'L ms':>4} {'runs':>4} " + " ".join(f"{'d' + str(d) + ' tok/s/run':>14}" for d in depths)
    header += f" {'1/L':>6} " + " ".join(f"{'d' + str(d) + ' hits':>8}" for d in depths if d)
    print(header)
    print("-" * len(header))
    for latency in args.latencies:
        for runs in args.runs:
            cell = {r["depth"]: r for r in rows if r["latency_ms"] == latency and r["runs"] == runs}
            line = f"{latency:>4} {runs:>4} " + " ".join(f"{cell[d]['per_run_tokens_per_s']:>14.1f}" for d in depths)
            line += f" {1000 / latency:>6.0f} " + " ".join(f"{cell[d]['hit_rate']:>8.1%}" for d in depths if d)
            print(line)
    one_run = [r for r in rows if r["depth"] == 1 and r["runs"] == 1]
    depth_1 = [r for r in rows if r["depth"] == 1]
    targets = {}  # only those the rows measured
    if one_run:
        targets["depth 1, one run: >= 0.9 x 1/L tokens/s"] = all(
            r["per_run_tokens_per_s"] >= 0.9 * r["ideal_tokens_per_s"] for r in one_run
        )
    if depth_1:
        targets["hit rate >= 95% on plain decode (depth 1)"] = all(r["hit_rate"] >= 0.95 for r in depth_1)
    for target, met in targets.items():
        print(f"target: {target}: {'met' if met else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "targets": targets, "work_us": WORK_US, "tokens": TOKENS}, indent=1))
    print(f"wrote {out}")


def measure(sandbox: Sandbox, component: Any, engine: Any, runs: int) -> tuple[float, int]:
    """One round: `runs` concurrent runs of TOKENS tokens; (wall seconds, speculation hits)."""
    before = engine.speculation_stats()
    t0 = time.perf_counter()
    handles = [
        sandbox.start(component, engine, ["--tokens", str(TOKENS), "--work-us", str(WORK_US)]) for _ in range(runs)
    ]
    outcomes = [h.wait() for h in handles]
    wall = time.perf_counter() - t0
    assert all(o.is_ok for o in outcomes), [o.error for o in outcomes if not o.is_ok]
    after = engine.speculation_stats()
    return wall, after["speculation_hits"] - before["speculation_hits"]


if __name__ == "__main__":
    main()
