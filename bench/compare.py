"""Side by side with the code before: run one benchmark on two revisions in alternated order
(A B, B A, ...), each from its own tree, and print the medians of every number its JSON holds
with the ratio new/old. For a refactor whose promise is "nothing slower".

The old revision is exported (`git archive`) to a temporary directory and its own copy of the
benchmark runs there, on its own `host` (PYTHONPATH), so a benchmark whose calls changed between
the revisions still runs on each; `--same-script` runs this tree's copy on both instead (for a
benchmark newer than the old revision, written to run on either). The benchmark must accept
`--out PATH` (every bench/ script does).

    python bench/compare.py --base REV [--repeats 3] [--keys tokens_per_s,us] [--out F] -- bench/X.py [ARGS]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Fields that name a row of a benchmark's table (its configuration), not a measurement.
ID_KEYS = (
    "loop",
    "case",
    "runs",
    "contexts",
    "depth",
    "speculation_depth",
    "batch",
    "latency_ms",
    "replicas",
    "rounds",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def flatten(value: Any, prefix: str = "") -> dict[str, float]:
    """Every number in a JSON document, keyed by its path; a list of rows is keyed by each row's
    configuration fields (`ID_KEYS`), so the same row lines up across runs."""
    out: dict[str, float] = {}
    if isinstance(value, bool):
        return out
    if isinstance(value, int | float):
        return {prefix: float(value)}
    if isinstance(value, dict):
        for key, inner in value.items():
            out |= flatten(inner, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            label = str(i)
            if isinstance(inner, dict):
                ids = [f"{k}={inner[k]}" for k in ID_KEYS if k in inner]
                label = ",".join(ids) or label
            out |= {k: v for k, v in flatten(inner, f"{prefix}[{label}]").items() if not _is_id(k)}
    return out


def _is_id(key: str) -> bool:
    return key.rsplit("].", 1)[-1] in ID_KEYS


def export(rev: str, into: Path) -> Path:
    tree = into / "base"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def run_once(tree: Path, bench: list[str], out: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    argv = [sys.executable, *bench, "--out", str(out)]
    proc = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{bench[0]} failed in {tree} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    log(f"  {tree.name}: {time.perf_counter() - t0:.0f} s")
    return flatten(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternated")
    parser.add_argument("--keys", default="", help="comma-separated substrings: show only keys with one")
    parser.add_argument(
        "--same-script",
        action="store_true",
        help="run this tree's copy of the benchmark on both (for one the old revision does not have)",
    )
    parser.add_argument("--out", default="bench/results/compare.json")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- bench/X.py [ARGS]")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        parser.error("name the benchmark after --")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    new_label = head.strip() + ("+changes" if dirty.strip() else "")
    samples: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": export(args.base, Path(tmp)), "new": ROOT}
        if args.same_script:
            shutil.copyfile(ROOT / bench[0], trees["old"] / bench[0])
        for i in range(args.repeats):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            log(f"repeat {i + 1}/{args.repeats}: {' then '.join(order)}")
            for side in order:
                samples[side].append(run_once(trees[side], bench, Path(tmp) / f"{side}{i}.json"))
    filters = [k for k in args.keys.split(",") if k]
    keys = [k for k in samples["new"][0] if k in samples["old"][0] and (not filters or any(f in k for f in filters))]
    rows = []
    for key in keys:
        old = statistics.median(s[key] for s in samples["old"] if key in s)
        new = statistics.median(s[key] for s in samples["new"] if key in s)
        rows.append({"key": key, "old": old, "new": new, "ratio": new / old if old else float("nan")})
    width = max((len(r["key"]) for r in rows), default=10)
    print(f"{' '.join(bench)}: medians of {args.repeats} alternated runs, old = {args.base}, new = {new_label}")
    print(f"{'key':<{width}} {'old':>12} {'new':>12} {'new/old':>8}")
    print("-" * (width + 35))
    for r in rows:
        print(f"{r['key']:<{width}} {r['old']:>12.4g} {r['new']:>12.4g} {r['ratio']:>8.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"bench": bench, "base": args.base, "new": new_label, "repeats": args.repeats}
    out.write_text(json.dumps({**meta, "rows": rows, "samples": samples}, indent=1))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
