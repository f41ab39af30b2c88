"""The engine core's own cost per token: its verbs driven in one thread, no loop, no driver, no
sandbox (a test plays the loop, as tests/host/test_engine_core.py does). N contexts each decode
T steps: submit a one-token decode, take the next batch, complete it with made-up tokens; with
speculation on, most steps are then served from the pass pre-fired after the previous one.

What this isolates: the host-side bookkeeping of a pass (check, pages, scheduler, staging,
routing), the part a refactor of the engine can make slower, without the thread hops, guest code
and driver time that make bench/host_overhead.py noisy on a small machine. CPU time of this one
thread, so other load moves it less than wall time.

Runs on any revision with `host.engine.core.EngineCore` (the staging layer or not), so that
`bench/compare.py --same-script` can set two side by side.

    python bench/engine_core.py [--contexts 1,8,64] [--steps 200] [--out bench/results/engine_core.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_name  # bench/, this script's folder

from bridge_schema.batch import OutputResult, OutputSpec, Sampler
from bridge_schema.messages import DEFERRED_TOKENS, Handshake
from host.engine import EngineConfig
from host.engine.core import EngineCore
from host.services import PassRequest, PassResult

RUN = 1


def build(depth: int) -> EngineCore:
    handshake = Handshake(
        model_name="bench",
        vocab_size=49152,
        page_size=16,
        num_pages=8192,
        max_context=8192,
        max_requests_per_pass=256,
        max_tokens_per_pass=8192,
        max_probe_k=8,
        capabilities=[DEFERRED_TOKENS],
    )
    config = EngineConfig("loopback", speculation_depth=depth)
    try:
        from host.engine.speculation import build_core
    except ImportError:  # before speculation was a layer around the core
        return EngineCore(config, handshake)
    return build_core(config, handshake)


def settle(core: EngineCore) -> None:
    """Give the waiters their outcomes, as the engine's lock does when released (revisions whose
    core resolves them itself have no `take_handovers`)."""
    take = getattr(core, "take_handovers", None)
    if take is not None:
        from host.engine.passes import resolve

        resolve(take())


def drive(depth: int, contexts: int, steps: int) -> dict[str, Any]:
    core = build(depth)
    ids = [core.create_context(RUN) for _ in range(contexts)]
    last = {c: 100 + c for c in ids}
    futures: dict[int, concurrent.futures.Future[PassResult]] = {}
    for c in ids:  # the prompt
        futures[c] = concurrent.futures.Future()
        core.submit(RUN, c, PassRequest(tokens=list(range(1, 33)), outputs=[OutputSpec(31, Sampler())]), futures[c])
    tokens = passes = 0
    started = time.process_time()
    for step in range(steps + 1):
        while any(not f.done() for f in futures.values()):
            batch = core.next_batch()
            assert batch is not None, "a pass waits and nothing was sent"
            outputs = [[OutputResult(1000 + step) for _ in chunk.spec.outputs] for chunk in batch.chunks]
            core.complete(batch, outputs, 0.001)
            settle(core)
            passes += 1
        if step == steps:
            break
        for c in ids:
            last[c] = futures[c].result(0).outputs[-1].token
            future: concurrent.futures.Future[PassResult] = concurrent.futures.Future()
            served = core.submit(RUN, c, PassRequest(tokens=[last[c]], outputs=[OutputSpec(0, Sampler())]), future)
            settle(core)
            if served is not None:
                future.set_result(served)
            futures[c] = future
            tokens += 1
    cpu_s = time.process_time() - started
    return {
        "speculation_depth": depth,
        "contexts": contexts,
        "tokens": tokens,
        "passes": passes,
        "us_per_token": cpu_s / tokens * 1e6,
        "tokens_per_cpu_s": tokens / cpu_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1,8,64")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="bench/results/engine_core.json")
    args = parser.parse_args()
    rows = []
    for depth in (1, 0):
        for n in (int(x) for x in args.contexts.split(",")):
            print(f"depth {depth}, {n} contexts ...", file=sys.stderr, flush=True)
            drive(depth, n, 10)  # warm-up
            rows.append(drive(depth, n, args.steps))
    print(f"engine core verbs, one thread, CPU time ({cpu_name()})")
    print(f"{'depth':>5} {'contexts':>8} {'tokens':>7} {'passes':>7} {'us/token':>9} {'tokens/cpu-s':>13}")
    for r in rows:
        print(
            f"{r['speculation_depth']:>5} {r['contexts']:>8} {r['tokens']:>7} {r['passes']:>7}"
            f" {r['us_per_token']:>9.1f} {r['tokens_per_cpu_s']:>13.0f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
