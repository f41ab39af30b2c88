"""One tenant attacks, another measures: the daemon with two API keys, a victim key sending chat
completions one after the other (and probing /health) while the attacker's key runs one attack
at a time; the victim's latency under each attack against the same requests on an idle daemon.

Attacks: `crowd` (a run decoding 1,000 contexts at once), `sleepers` (8 hand-built components
that wait in WASI 0.2.0's clock), `hogs` (8 hand-built components asking for 8 memories of
240 MiB), `prompts` (4 clients sending completions of 128 prompts x 2 choices, the most a
request may have), `too-many` (runs that create contexts past run_max_contexts).

    python bench/tenancy.py [--requests 40] [--latency-ms 5] [--attacks crowd,sleepers,...]

Prints a table (p50, p99 and their ratio to idle; the slowest /health) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' hand-built components

from host.build import build
from host.sandbox.config import default_cache_dir
from tests.host.sandbox import hand_built

VICTIM, ATTACKER = "victim-key", "attacker-key"
CROWD = Path(__file__).resolve().parent.parent / "tests" / "host" / "daemon" / "inferlets" / "crowd"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@contextmanager
def daemon(latency_ms: float) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WAFER_API_KEYS": f"{VICTIM},{ATTACKER}"}
    command = [sys.executable, "-m", "host.daemon", "--port", str(port), "--driver", "dummy", "--log-level", "error"]
    command += [f"--driver-arg=--pass-latency-ms={latency_ms}"]
    with tempfile.TemporaryDirectory() as data_dir:
        proc = subprocess.Popen([*command, "--data-dir", data_dir], stdout=subprocess.DEVNULL, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the daemon did not start")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def victim(url: str, num_requests: int) -> dict[str, Any]:
    """`num_requests` chats one after the other, and /health probed every 50 ms meanwhile."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=VICTIM, max_retries=0, timeout=120)
    health: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=60) as http:
            while not done.is_set():
                start = time.perf_counter()
                http.get(f"{url}/health")
                health.append(time.perf_counter() - start)
                done.wait(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    latencies: list[float] = []
    errors: list[str] = []
    for i in range(num_requests):
        start = time.perf_counter()
        try:
            client.chat.completions.create(
                model="dummy", messages=[{"role": "user", "content": "hello"}], max_tokens=16, seed=i
            )
            latencies.append(time.perf_counter() - start)
        except openai.APIError as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
    done.set()
    prober.join()
    return {
        "p50_s": pct(latencies, 0.5),
        "p99_s": pct(latencies, 0.99),
        "health_max_s": max(health, default=float("nan")),
        "num_ok": len(latencies),
        "errors": errors[:3],
        "latencies_s": latencies,  # in the order sent: where in the attack the slow ones fell
    }


def _upload(http: httpx.Client, data: bytes) -> str | None:
    response = http.post("/v1/inferlets", content=data)
    return str(response.json()["id"]) if response.status_code in (200, 201) else None


def _runs(http: httpx.Client, inferlet: str | None, args: list[str], count: int) -> list[str]:
    if inferlet is None:
        return []
    return [http.post("/v1/runs", json={"inferlet": inferlet, "args": args}).json().get("id", "") for _ in range(count)]


def attack(url: str, name: str, stop: threading.Event, tmp: Path) -> Callable[[], None]:
    """Start attack `name`; returns what undoes it."""
    http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ATTACKER}"}, timeout=600)
    runs: list[str] = []
    threads: list[threading.Thread] = []
    if name == "crowd":
        crowd = _upload(http, build(str(CROWD), default_cache_dir()).wasm_path.read_bytes())
        runs = _runs(http, crowd, ["1000"], 1)
    elif name == "too-many":

        def again() -> None:
            crowd = _upload(http, build(str(CROWD), default_cache_dir()).wasm_path.read_bytes())
            while not stop.is_set():
                for run in _runs(http, crowd, ["1100"], 2):
                    while http.get(f"/v1/runs/{run}").json().get("state") == "running" and not stop.is_set():
                        time.sleep(0.05)

        threads.append(threading.Thread(target=again, daemon=True))
    elif name in ("sleepers", "hogs"):
        text = hand_built.clock_sleeper("0.2.0", 3600) if name == "sleepers" else hand_built.many_memories(8, 240)
        uploaded = _upload(http, hand_built.write(text, tmp / f"{name}.wasm").read_bytes())

        def keep_starting() -> None:
            while not stop.is_set():
                _runs(http, uploaded, [], 8)
                time.sleep(0.1)

        threads.append(threading.Thread(target=keep_starting, daemon=True))
    elif name == "prompts":
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=ATTACKER, max_retries=0, timeout=600)

        def flood() -> None:
            while not stop.is_set():
                try:
                    client.completions.create(model="dummy", prompt=["a b c"] * 128, n=2, max_tokens=16)
                except openai.RateLimitError:  # out of run slots for this key: try again, as a client would
                    time.sleep(0.05)

        threads += [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    else:
        raise SystemExit(f"unknown attack {name!r}")
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # let it take hold

    def undo() -> None:
        stop.set()
        for run in runs:
            http.post(f"/v1/runs/{run}/cancel")
        for thread in threads:
            thread.join(timeout=120)
        http.close()

    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="victim chats per phase")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="the dummy driver's time per pass")
    parser.add_argument("--attacks", default="crowd,too-many,sleepers,hogs,prompts")
    parser.add_argument("--out", default="bench/results/tenancy.json")
    ns = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with daemon(ns.latency_ms) as url, tempfile.TemporaryDirectory() as tmp:
        log("warming up")
        victim(url, 3)
        log("idle")
        idle = victim(url, ns.requests)
        rows.append({"attack": "idle", **idle})
        for name in ns.attacks.split(","):
            log(f"attack: {name}")
            stop = threading.Event()
            undo = attack(url, name, stop, Path(tmp))
            try:
                rows.append({"attack": name, **victim(url, ns.requests)})
            finally:
                undo()
    idle_p50, idle_p99 = rows[0]["p50_s"], rows[0]["p99_s"]
    header = f"{'attack':<10} {'ok':>4} {'p50 ms':>8} {'p99 ms':>8} {'p50/idle':>9} {'p99/idle':>9}"
    print(f"{header} {'/health max ms':>15}")
    for row in rows:
        row["p50_ratio"] = row["p50_s"] / idle_p50
        row["p99_ratio"] = row["p99_s"] / idle_p99
        print(
            f"{row['attack']:<10} {row['num_ok']:>4} {row['p50_s'] * 1e3:>8.1f} {row['p99_s'] * 1e3:>8.1f} "
            f"{row['p50_ratio']:>9.2f} {row['p99_ratio']:>9.2f} {row['health_max_s'] * 1e3:>15.1f}"
        )
        for error in row["errors"]:
            print(f"  {error}")
    print(f"median p99/idle over the attacks: {statistics.median(r['p99_ratio'] for r in rows[1:]):.2f}")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"requests": ns.requests, "latency_ms": ns.latency_ms, "cpu": _cpu(), "rows": rows}
    out.write_text(json.dumps(record, indent=1))
    log(f"wrote {out}")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
