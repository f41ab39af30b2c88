"""The inferlet author's loop: how long from a one-line edit to the first output of `wafer run`
on the dummy driver, as an author sees it (the `wafer` command in a fresh process each time), on
wafer's shared base and, side by side, as a snapshot build (`--snapshot`: componentize-py per
build, a compile per build). Also a cold first build (empty cache: the base is built and
compiled), and where an edit's time goes, measured in-process: build, load (compiled component),
engine start (the dummy driver process), and run start to first output.

    python bench/author_loop.py [--edits 5] [--snapshot-edits 2] [--out bench/results/author_loop.json]

Each edit changes one line of a copy of `inferlets/hello` (the greeting), so each build is new.
Medians over the edits; this machine's other load shows in the spread (min and max printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "inferlets" / "hello"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def wafer(*argv: str) -> list[str]:
    return [sys.executable, "-m", "host.cli", *argv]


def edit(folder: Path, i: int) -> None:
    app = folder / "app.py"
    lines = app.read_text().splitlines(keepends=True)
    at = next(n for n, line in enumerate(lines) if 'emit(f"Hello' in line)
    lines[at] = f'    emit(f"Hello #{i}, {{name}}! This is {{model_info().name}}.\\n")\n'
    app.write_text("".join(lines))


def first_output_s(argv: list[str]) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds to exit) of a command."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    errors: list[bytes] = []
    reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    first = proc.stdout.read(1)
    first_s = time.perf_counter() - start
    proc.stdout.read()
    code = proc.wait()
    reader.join()
    if code != 0 or not first:
        raise RuntimeError(f"{' '.join(argv)} failed ({code}): {b''.join(errors).decode()[-2000:]}")
    return first_s, time.perf_counter() - start


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - start


def cli_loop(folder: Path, cache: Path, edits: int, snapshot: bool, start_index: int) -> list[dict[str, float]]:
    """Edit, `wafer build`, `wafer run` (to its first output), `edits` times."""
    flags = ["--snapshot"] if snapshot else []
    rows = []
    for i in range(edits):
        edit(folder, start_index + i)
        build_s = timed(wafer("--cache-dir", str(cache), "build", *flags, str(folder)))
        first_s, exit_s = first_output_s(wafer("--cache-dir", str(cache), "run", *flags, "--no-stdin", str(folder)))
        rows.append(
            {"build_s": build_s, "run_first_output_s": first_s, "run_exit_s": exit_s, "total_s": build_s + first_s}
        )
        kind = "snapshot" if snapshot else "base"
        log(f"  {kind} edit {i + 1}/{edits}: build {build_s:.2f} s + first output {first_s:.2f} s")
    return rows


def in_process_breakdown(folder: Path, cache: Path, edits: int, start_index: int) -> list[dict[str, float]]:
    """Where an edit's time goes, in one process (so without the interpreter's start)."""
    from host.build import build
    from host.engine import Engine, EngineConfig
    from host.sandbox import BufferedRunIO, Sandbox, SandboxConfig

    rows = []
    for i in range(edits):
        edit(folder, start_index + i)
        t0 = time.perf_counter()
        wasm = build(str(folder), cache).wasm_path
        t1 = time.perf_counter()
        with Sandbox(SandboxConfig(cache_dir=cache)) as sandbox:
            loaded = sandbox.load(wasm)
            t2 = time.perf_counter()
            with Engine.start(EngineConfig("dummy")) as engine:
                t3 = time.perf_counter()
                first = threading.Event()
                io = BufferedRunIO(on_chunk=lambda _chunk, seen=first: seen.set())
                handle = sandbox.start(loaded, engine, [], io=io)
                first.wait(60)
                t4 = time.perf_counter()
                handle.wait(60)
        rows.append(
            {"build_s": t1 - t0, "load_s": t2 - t1, "engine_start_s": t3 - t2, "run_to_first_output_s": t4 - t3}
        )
    return rows


def summary(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {
        key: {
            "median": statistics.median(r[key] for r in rows),
            "min": min(r[key] for r in rows),
            "max": max(r[key] for r in rows),
        }
        for key in rows[0]
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edits", type=int, default=5)
    parser.add_argument("--snapshot-edits", type=int, default=2, help="edits timed as snapshot builds (slow)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "author_loop.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    with tempfile.TemporaryDirectory(prefix="wafer-author-loop-") as tmp:
        cache, folder = Path(tmp) / "cache", Path(tmp) / "my_inferlet"
        shutil.copytree(EXAMPLE, folder)
        log("cold first build (empty cache: the base is built, then compiled for this machine)")
        cold_build_s = timed(wafer("--cache-dir", str(cache), "build", str(folder)))
        cold_first_s, _ = first_output_s(wafer("--cache-dir", str(cache), "run", "--no-stdin", str(folder)))
        log(f"  cold: build {cold_build_s:.1f} s, then first output {cold_first_s:.2f} s")
        log(f"edit loop on wafer's base ({args.edits} edits)")
        base = cli_loop(folder, cache, args.edits, snapshot=False, start_index=0)
        log("where an edit's time goes (in-process)")
        stages = in_process_breakdown(folder, cache, args.edits, start_index=100)
        log(f"edit loop with snapshot builds ({args.snapshot_edits} edits, each a componentize-py run and a compile)")
        snap = cli_loop(folder, cache, args.snapshot_edits, True, 200) if args.snapshot_edits else []

    result: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "cold": {"build_s": cold_build_s, "run_first_output_s": cold_first_s},
        "base": summary(base),
        "stages": summary(stages),
        "snapshot": summary(snap) if snap else None,
        "edits": {"base": base, "stages": stages, "snapshot": snap},
    }
    print(f"\n{'edit -> first output':<34}{'base':>12}{'snapshot':>12}{'ratio':>9}")
    labels = {
        "build_s": "wafer build (s)",
        "run_first_output_s": "wafer run to first output (s)",
        "total_s": "edit to first output (s)",
    }
    for key, label in labels.items():
        b = result["base"][key]["median"]
        s = result["snapshot"][key]["median"] if snap else float("nan")
        print(f"{label:<34}{b:>12.2f}{s:>12.2f}{s / b:>8.1f}x")
    print(f"\ncold first build {cold_build_s:.1f} s; then first output {cold_first_s:.2f} s")
    print("\nwhere an edit's time goes on the base (in-process medians, s):")
    for key, stats in result["stages"].items():
        print(f"  {key:<26}{stats['median']:>8.3f}   (min {stats['min']:.3f}, max {stats['max']:.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
