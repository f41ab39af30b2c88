"""Prefix reuse and speculative decoding on SmolLM2 (torch driver, this CPU), side by side:

- time to first token with a shared ~1k-token system prompt, cold (nothing cached) vs warm (the
  system prompt's pages reused), medians of a few requests with different questions;
- tokens/s of spec_ngram against plain decoding (the same inferlet with --draft 0) on a
  copy-heavy task (rewrite a text with small edits), with the draft acceptance rate.

    python bench/prefix_spec.py [--threads N] [--out bench/results/prefix_spec.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bridge_schema.batch import OutputSpec, Sampler
from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox.config import SandboxConfig, default_cache_dir
from host.sandbox.run_io import BufferedRunIO
from host.sandbox.sandbox import Sandbox
from host.services import PassRequest

PAGE = 16
SYSTEM = (
    "You are a meticulous assistant for a city library. You answer questions about opening hours, "
    "membership, borrowing rules, fines, events and the catalogue. Be brief and exact. "
) * 28
QUESTIONS = ["When do you open on Sunday?", "How long can I keep a book?", "Is membership free?", "Do you have DVDs?"]
COPY_TASK = (
    "Rewrite the following text, replacing every 'Tuesday' with 'Wednesday' and keeping everything "
    "else exactly the same:\n\nThe committee met on Tuesday to review the budget. On Tuesday the "
    "committee agreed to fund the library, the park and the new school. The committee will meet "
    "again next Tuesday to review the budget for the library, the park and the new school, and on "
    "Tuesday it will publish the minutes of every meeting held since the spring."
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def first_token_s(engine: Engine, run: int, text: str) -> float:
    tokens = engine.tokenizer.encode(text)
    ctx = engine.create_context(run)
    t0 = time.perf_counter()
    engine.forward(run, ctx, PassRequest(tokens=tokens, outputs=[OutputSpec(len(tokens) - 1, Sampler())]))
    return time.perf_counter() - t0


def chat(engine: Engine, system: str, question: str) -> str:
    return engine.tokenizer.apply_chat_template([("system", system), ("user", question)], True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="bench/results/prefix_spec.json")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = parser.parse_args()
    driver_args = ["--threads", str(args.threads), "--dtype", "float32", "--num-pages", "1024"]
    log(f"starting the torch driver with SmolLM2 ({args.threads} thread(s)) ...")
    with Engine.start(
        EngineConfig(
            "torch", driver_args, page_size=PAGE, prefix_match_unit=PAGE, speculation_depth=1, startup_timeout_s=600
        )
    ) as engine:
        system_tokens = len(engine.tokenizer.encode(SYSTEM))
        log(f"time to first token, system prompt of {system_tokens} tokens ...")
        first_token_s(engine, 1, chat(engine, "Warm-up. " + SYSTEM[:200], "Hi"))
        cold = [first_token_s(engine, 2, chat(engine, f"[{i}] " + SYSTEM, q)) for i, q in enumerate(QUESTIONS)]
        first_token_s(engine, 3, chat(engine, SYSTEM, "Prime the cache."))
        warm = [first_token_s(engine, 4, chat(engine, SYSTEM, q)) for q in QUESTIONS]
        reused = engine.prefix_stats()["prefix_tokens_reused"]
        engine.end_run(2)
        engine.end_run(4)
        log("spec_ngram vs plain decoding on a copy-heavy task ...")
        wasm = build("spec_ngram", args.cache_dir, log).wasm_path
        results = {}
        with Sandbox(SandboxConfig(cache_dir=args.cache_dir)) as sandbox:
            component = sandbox.load(wasm)
            for name, extra in (("plain", ["--draft", "0"]), ("spec_ngram", [])):
                io = BufferedRunIO()
                t0 = time.perf_counter()
                task = ["--prompt", COPY_TASK, "--chat", "--max-tokens", str(args.max_tokens), *extra]
                outcome = sandbox.run(component, engine, task, io=io)
                wall = time.perf_counter() - t0
                assert outcome.is_ok, outcome.error
                stats = json.loads(io.sent[-1])
                results[name] = {
                    "output": outcome.output,
                    "tokens": stats["generated"],
                    "tokens_per_s": stats["generated"] / wall,
                    "passes": stats["passes"],
                    "acceptance": stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0,
                }
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    plain, spec = results["plain"], results["spec_ngram"]
    print(f"threads: {args.threads}; system prompt: {system_tokens} tokens; page size {PAGE}")
    print(f"{'time to first token':<28} {'cold':>9} {'warm':>9} {'warm/cold':>10}")
    print(f"{'  median of 4 (ms)':<28} {cold_s * 1e3:>9.0f} {warm_s * 1e3:>9.0f} {warm_s / cold_s:>10.2f}")
    print(f"{'copy-heavy task':<28} {'tokens':>9} {'passes':>9} {'tok/s':>10} {'accepted':>9}")
    for name, r in results.items():
        print(f"{'  ' + name:<28} {r['tokens']:>9} {r['passes']:>9} {r['tokens_per_s']:>10.1f} {r['acceptance']:>9.0%}")
    same = plain["output"] == spec["output"]
    speedup = spec["tokens_per_s"] / plain["tokens_per_s"]
    print(f"spec_ngram output identical to plain decoding: {same}; speedup {speedup:.2f}x")
    targets = {
        "warm time to first token <= 25% of cold": warm_s <= 0.25 * cold_s,
        "spec_ngram >= 1.5x plain decoding on the copy-heavy task": spec["tokens_per_s"] >= 1.5 * plain["tokens_per_s"],
    }
    for target, met in targets.items():
        print(f"target: {target}: {'met' if met else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "threads": args.threads,
        "system_prompt_tokens": system_tokens,
        "cold_s": cold,
        "warm_s": warm,
        "prefix_tokens_reused": reused,
        "copy_task": {k: {kk: vv for kk, vv in v.items() if kk != "output"} for k, v in results.items()},
        "identical_output": same,
        "targets": targets,
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
