"""The engine lock under grammar-constrained generation: 32 runs of the chat inferlet, each a
host-side generation (`Context.complete`) masked by a JSON-schema grammar, on the dummy driver,
then again while a probe thread takes the engine's lock every millisecond (`engine.num_free_pages`,
one lock round trip) and times each take. A run thread's every call needs that lock; the probe's wait is what theirs
is when the loop thread holds it (e.g. while it fills grammar bitmasks).

Prints a table, writes JSON. Runs on the code before the engine package too, so that
`bench/compare.py --same-script` can set the two side by side.

    python bench/engine_lock.py [--runs 32] [--tokens 48] [--out bench/results/engine_lock.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve import chat_request
from host.build import build
from host.engine import Engine
from host.sandbox import BufferedRunIO, Sandbox, SandboxConfig
from host.sandbox.config import default_cache_dir

SCHEMA = {
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["lines"],
}
DRIVER_ARGS = ("--num-pages", "8192", "--pass-latency-ms", "1")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def start_engine() -> Engine:
    try:
        from host.engine import EngineConfig
    except ImportError:  # the code before the engine package: keyword arguments
        return Engine.start("dummy", list(DRIVER_ARGS), speculation_depth=1)  # type: ignore[call-arg]
    return Engine.start(EngineConfig("dummy", DRIVER_ARGS, speculation_depth=1))


def request(tokens: int, seed: int) -> str:
    options = {"strict": False, "reject_unsupported": True, "max_length_limit": 2**31 - 1}
    grammar = {"kind": "json-schema", "text": json.dumps(SCHEMA), "options": options}
    return json.dumps({**chat_request("List forty short lines, as JSON.", tokens), "seed": seed, "grammar": grammar})


def percentile(samples: list[float], q: float) -> float:
    return samples[min(len(samples) - 1, int(q * len(samples)))]


def measure(sandbox: Sandbox, engine: Engine, component: Any, runs: int, tokens: int, probe: bool) -> dict[str, float]:
    """`runs` generations at once. With `probe`, a thread takes the engine lock every millisecond
    (a fixed rate, so that both revisions are probed alike) and the wait for it is reported;
    without, the throughput and the loop's time per token are."""
    waits: list[float] = []
    done = threading.Event()

    def take_lock_every_ms() -> None:
        due = time.perf_counter()
        while not done.is_set():
            t0 = time.perf_counter()
            engine.num_free_pages  # noqa: B018 - one take of the engine lock
            waits.append(time.perf_counter() - t0)
            due += 0.001
            time.sleep(max(0.0, due - time.perf_counter()))

    timing0 = engine.timing_stats()
    prober = threading.Thread(target=take_lock_every_ms, daemon=True)
    t0 = time.perf_counter()
    ios = [BufferedRunIO() for _ in range(runs)]
    handles = [sandbox.start(component, engine, [request(tokens, i)], io=io) for i, io in enumerate(ios)]
    if probe:
        prober.start()
    outcomes = [h.wait() for h in handles]
    wall = time.perf_counter() - t0
    done.set()
    if probe:
        prober.join()
    bad = [o for o in outcomes if not o.is_ok]
    if bad:
        raise RuntimeError(f"{len(bad)} runs failed, e.g. {bad[0].status}: {bad[0].error}")
    generated = sum(n for io in ios for m in io.sent for _i, _r, n in json.loads(m).get("finished", ()))
    if probe:
        waits.sort()
        return {
            "lock_wait_p50_us": percentile(waits, 0.5) * 1e6,
            "lock_wait_p99_us": percentile(waits, 0.99) * 1e6,
            "lock_wait_max_us": waits[-1] * 1e6,
        }
    timing = {k: v - timing0[k] for k, v in engine.timing_stats().items()}
    return {
        "tokens": generated,
        "tokens_per_s": generated / wall,
        "loop_complete_us_per_token": timing["complete_s"] * 1e6 / max(generated, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/engine_lock.json")
    args = parser.parse_args()
    log("building the chat inferlet (cached after the first time) ...")
    wasm = build("chat", default_cache_dir(), log, snapshot=True).wasm_path
    rows = []
    with Sandbox(SandboxConfig(cache_dir=default_cache_dir())) as sandbox, start_engine() as engine:
        component = sandbox.load(wasm)
        log("warm-up (compiles the grammar once) ...")
        measure(sandbox, engine, component, 2, 8, False)
        for i in range(args.repeats):
            log(f"{args.runs} grammar-constrained runs x {args.tokens} tokens, repeat {i + 1}/{args.repeats} ...")
            row = measure(sandbox, engine, component, args.runs, args.tokens, False)
            rows.append(row | measure(sandbox, engine, component, args.runs, args.tokens, True))
    keys = list(rows[0])
    median = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in keys}
    print(f"{args.runs} grammar-constrained host-side generations, dummy driver; medians of {args.repeats}")
    for k in keys:
        print(f"  {k:<28} {median[k]:>10.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"median": median, "repeats": rows, "runs": args.runs}, indent=1))


if __name__ == "__main__":
    main()
