"""The [portable] acceptance bars measured on the CPU at hand, in one run, each with its verdict.

Runs `bench/decode.py` once, side by side: float32 and the configuration the driver names fastest on
this CPU (`float32+w8a8+compile+kv16` where the int8 matmuls have a vector kernel; float32 where
they run the portable one), batches 1 and 8, llama.cpp on the same GGUF and transformers on the same
prompts; then reads its JSON and checks each bar:

- batch-1 decode of the fastest configuration at least 0.6x llama.cpp's (stretch: 1x);
- batch-1 decode of the fastest configuration at least 70% of its bandwidth bound (the weight bytes a
  step reads over the read bandwidth measured in the same run);
- batch-8 decode of the fastest configuration at least 3x transformers';
- w8a8 prefill at least float32's, at batch 1 and at batch 8.

Prints the CPU and its vector features, decode.py's tables, then one line per bar (measured, target,
met), and writes JSON with decode.py's result inside. The bars are written for an AVX2-only CPU; on
another kind of CPU the verdicts still print, marked as measured on that kind. `--isa avx2` caps every
kernel (the C++ kernels through the entry, torch's and Inductor's through ATEN_CPU_CAPABILITY): the
nearest an AVX-512 machine gets to an AVX2-only one, and still an emulation. One machine's runs differ
by up to ten points of the bound: run it two or three times and report the spread.

    python bench/portable_check.py [--threads 2] [--isa avx2] [--out bench/results/portable_check.json]
    python bench/portable_check.py --from-json bench/results/decode.json   # only judge an earlier run

Needs llama-cpp-python (`pip install 'llama-cpp-python==0.3.36'`, built from its sdist: ~10 minutes on
2 cores; `make portable-check` installs it). ~8 minutes on 2 cores after the first compile. Not part
of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drivers.torch.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]

BASELINE = "float32"
VS_LLAMACPP, VS_LLAMACPP_STRETCH, OF_BOUND, VS_TRANSFORMERS = 0.6, 1.0, 0.70, 3.0


def fastest_entry(w8a8_variant: str) -> str:
    """The decode.py entry of the configuration the driver names fastest on this CPU
    (`TorchDriver.faster_configuration`): w8a8, compiled, a float16 KV cache, where the int8
    matmuls have a vector kernel; float32 where they run the portable one (there w8a8 is slower)."""
    return BASELINE if w8a8_variant in ("", "portable") else "float32+w8a8+compile+kv16"


def _row(result: dict[str, Any], dtype: str, batch: int) -> dict[str, Any]:
    for row in result["rows"]:
        if row["dtype"] == dtype and row["batch"] == batch:
            return row
    raise SystemExit(f"decode.py's result has no row for {dtype} at batch {batch}")


def evaluate(result: dict[str, Any], best: str, baseline: str) -> list[dict[str, Any]]:
    """Each bar of the acceptance against decode.py's JSON `result` (its `rows` and `peers`), for the
    entry `best` next to `baseline` (float32): a list of {bar, measured, target, met}. A bar whose
    inputs the run lacks (no llama.cpp, no transformers) is reported with measured None, not met."""
    one, eight = _row(result, best, 1), _row(result, best, 8)
    peer = next((p for p in result.get("peers", []) if p.get("peer") == "llama.cpp"), None)

    def ratio(num: float, den: float | None) -> float | None:
        return None if den is None or den != den or den <= 0 else num / den

    vs_peer = ratio(one["decode_tok_s"], peer["decode_tok_s"] if peer else None)
    bars = [
        ("batch-1 decode vs llama.cpp", vs_peer, VS_LLAMACPP),
        ("batch-1 decode vs llama.cpp (stretch)", vs_peer, VS_LLAMACPP_STRETCH),
        (
            "batch-1 decode, share of the bandwidth bound",
            ratio(one["decode_tok_s"], one["decode_bound_tok_s"]),
            OF_BOUND,
        ),
        ("batch-8 decode vs transformers", ratio(eight["decode_tok_s"], eight["hf_decode_tok_s"]), VS_TRANSFORMERS),
    ]
    if best != baseline:
        for batch in (1, 8):
            base = _row(result, baseline, batch)["prefill_tok_s"]
            bars.append(
                (
                    f"w8a8 prefill vs float32, batch {batch}",
                    ratio(_row(result, best, batch)["prefill_tok_s"], base),
                    1.0,
                )
            )
    return [
        {"bar": bar, "measured": measured, "target": target, "met": measured is not None and measured >= target}
        for bar, measured, target in bars
    ]


def report(verdicts: list[dict[str, Any]], best: str, cpu: dict[str, Any]) -> str:
    """The verdicts as a table, under a line naming the CPU, its kind and any cap on the kernels."""
    features = set(cpu.get("features", []))
    kind = "AVX-512" if any(f.startswith("avx512") for f in features) else "AVX2" if "avx2" in features else "other"
    cap = next((f for f in best.split("+")[1:] if f in cpu_kernels.ISAS), "")
    capped = f"; C++ kernels capped at {cap}, torch's at {cpu.get('torch_isa', '?')}" if cap else ""
    lines = [
        f"[portable] acceptance, {best} on {cpu.get('model', '?')} ({kind} CPU{capped}):",
        "",
        "| bar | measured | target | met |",
        "|---|---|---|---|",
    ]
    for v in verdicts:
        share = "bound" in v["bar"]
        target = f"{v['target']:.0%}" if share else f"{v['target']:.1f}x"
        measured = (
            "not measured" if v["measured"] is None else f"{v['measured']:.0%}" if share else f"{v['measured']:.2f}x"
        )
        lines.append(f"| {v['bar']} | {measured} | {target} | {'yes' if v['met'] else 'NO'} |")
    if kind != "AVX2" or cap:
        lines += ["", "The bars name an AVX2-only CPU: a run on another kind, or capped, only approximates it."]
    return "\n".join(lines)


def run_decode(args: argparse.Namespace, entries: list[str], out: Path) -> None:
    command = [
        sys.executable, str(ROOT / "bench" / "decode.py"), "--threads", str(args.threads),
        "--dtype", ",".join(entries), "--batches", "1,8", "--peer", "llamacpp", "--repeats", str(args.repeats),
        "--new-tokens", str(args.new_tokens), "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ)
    if args.isa:  # torch's own kernels and Inductor's code at the same level (its names for them)
        env["ATEN_CPU_CAPABILITY"] = {"portable": "default", "avx2_vnni": "avx2", "avx512_vnni": "avx512"}.get(
            args.isa, args.isa
        )
    print("running:", " ".join(command[1:]), flush=True)
    subprocess.run(command, env=env, check=True)


def variant(isa: str) -> str:
    """The variant the int8 matmuls run on this CPU under the cap `isa` ("" where not built)."""
    if not cpu_kernels.load(show_progress=False):
        return ""
    if not isa:
        return cpu_kernels.variants()["w8a8"]
    with cpu_kernels.limit_isa(isa):
        return cpu_kernels.variants()["w8a8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="default: all cores")
    parser.add_argument(
        "--isa",
        default="",
        choices=["", *cpu_kernels.ISAS],
        help="cap every kernel at this level (avx2: emulate an AVX2-only CPU)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs per measurement")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--from-json", default="", help="judge this decode.py result instead of running one")
    parser.add_argument("--out", default="bench/results/portable_check.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        # decode.py's entries in the order given: the baseline first, the fastest last.
        result = json.loads(Path(args.from_json).read_text())
        entries = list(dict.fromkeys(row["dtype"] for row in result["rows"]))
    else:
        entries = [
            f"{e}+{args.isa}" if args.isa else e for e in dict.fromkeys([BASELINE, fastest_entry(variant(args.isa))])
        ]
        decode_json = out.with_name(out.stem + "_decode.json")
        run_decode(args, entries, decode_json)
        result = json.loads(decode_json.read_text())
    best = entries[-1]
    verdicts = evaluate(result, best, entries[0])
    print()
    print(report(verdicts, best, result["meta"]["cpu"]))
    out.write_text(json.dumps({"best": best, "baseline": entries[0], "verdicts": verdicts, "decode": result}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
