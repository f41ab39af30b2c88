"""The daemon over HTTP against the same work in-process: N concurrent streaming chat requests
(SSE; from the real openai client and from a lean asyncio client, see CLIENTS) next to N runs
of the same chat inferlet started directly in the sandbox; throughput, time to first token and
inter-token latency (p50, p99). Dummy driver with a simulated pass latency by default; --smollm2
for the real model. Every stream generates exactly `--tokens` tokens (ignore_eos), counted by the
generator (usage over HTTP).

    python bench/serve.py [--streams 32] [--tokens 64] [--latency-ms 5] [--smollm2]
                          [--driver-args="--weights w8a8 --compile --kv-dtype float16"]

`--driver-args` (with --smollm2) gives the torch driver its options (default: --dtype float32).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox.config import SandboxConfig, default_cache_dir
from host.sandbox.run_io import BufferedRunIO
from host.sandbox.sandbox import Sandbox

QUESTION = "Tell me a story about a lighthouse keeper."
# "openai": the real openai client, one thread per stream, as applications call the daemon;
# "lean": one asyncio loop reading the SSE bytes, so the client takes little of the CPU it shares
# with the daemon on one machine (a deployment's clients run on other machines).
CLIENTS = ("openai", "lean")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class CpuClock:
    """CPU seconds (user and system) used so far by this process and by the daemon's process
    (Linux's /proc; 0 without a daemon). Neither counts the driver's process."""

    def __init__(self, daemon_pid: int | None = None) -> None:
        self._daemon_pid = daemon_pid

    def read(self) -> tuple[float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        daemon = 0.0
        if self._daemon_pid is not None:
            fields = Path(f"/proc/{self._daemon_pid}/stat").read_text().rpartition(")")[2].split()
            daemon = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return own.ru_utime + own.ru_stime, daemon

    def since(self, start: tuple[float, float]) -> dict[str, float]:
        """CPU seconds since `start` (a `read`) of the host (in-process: this process; over HTTP:
        the daemon) and of the client (over HTTP: this process)."""
        own, daemon = self.read()
        if self._daemon_pid is None:
            return {"host_cpu_s": own - start[0], "client_cpu_s": 0.0}
        return {"host_cpu_s": daemon - start[1], "client_cpu_s": own - start[0]}


def summarize(
    starts: list[float], stamps: list[list[float]], tokens: int, wall_s: float, cpu: dict[str, float]
) -> dict[str, float]:
    """`tokens`: generated tokens, counted by the generator (a step whose bytes are not yet a
    whole character has no text, so counting text pieces would undercount); `cpu`: from
    `CpuClock.since`."""
    ttft = [s[0] - t0 for t0, s in zip(starts, stamps, strict=True) if s]
    itl = [b - a for s in stamps for a, b in itertools.pairwise(s)]
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall_s,
        **cpu,
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
        "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
        "itl_p50_ms": pct(itl, 0.5) * 1e3,
        "itl_p99_ms": pct(itl, 0.99) * 1e3,
    }


class TimedIO(BufferedRunIO):
    """Records when each generated piece arrives: a message per step from the chat inferlet's own
    loop, or a chunk of output per token when the host runs the loop (what the daemon reads as
    the deltas of choice 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[float] = []
        self.generated = 0

    def emit(self, chunk: str) -> None:
        now = time.perf_counter()
        super().emit(chunk)
        if chunk:
            self.stamps.append(now)

    def send(self, message: str) -> None:
        now = time.perf_counter()
        super().send(message)
        body = json.loads(message)
        for _index, text, _logprobs in body.get("deltas", ()):
            if text:  # as over HTTP: a step with no text yet sends no chunk
                self.stamps.append(now)
        self.generated += sum(num_tokens for _index, _reason, num_tokens in body.get("finished", ()))


def chat_request(question: str, tokens: int) -> dict[str, Any]:
    """The chat inferlet's argument for one sampled choice of `tokens` tokens (ignore_eos: every
    stream generates exactly that many, unless a grammar ends it)."""
    return {
        "prompts": [{"messages": [["user", question]]}],
        "n": 1,
        "max_tokens": tokens,
        "stop": [],
        "temperature": 1.0,
        "top_p": 1.0,
        "logprobs": False,
        "top_logprobs": 0,
        "ignore_eos": True,
    }


def in_process(driver: str, driver_args: list[str], streams: int, tokens: int, model: str) -> dict[str, float]:
    wasm = build("chat", default_cache_dir(), snapshot=True).wasm_path
    request = chat_request(QUESTION, tokens)
    with (
        Sandbox(SandboxConfig(cache_dir=default_cache_dir())) as sandbox,
        Engine.start(EngineConfig(driver, driver_args, speculation_depth=1, startup_timeout_s=600)) as engine,
    ):
        component = sandbox.load(wasm)
        ios = [TimedIO() for _ in range(streams)]
        starts, handles = [], []
        clock = CpuClock()
        cpu0 = clock.read()
        t0 = time.perf_counter()
        for i, io in enumerate(ios):
            starts.append(time.perf_counter())
            handles.append(sandbox.start(component, engine, [json.dumps({**request, "seed": i})], io=io))
        for h in handles:
            assert h.wait().is_ok
        wall = time.perf_counter() - t0
        cpu = clock.since(cpu0)
        return summarize(starts, [io.stamps for io in ios], sum(io.generated for io in ios), wall, cpu)


def over_http(
    driver: str, driver_args: list[str], streams: int, tokens: int, model: str, client: str
) -> dict[str, float]:
    """The daemon in its own process (as deployed), so the client here does not share its GIL;
    `client`: "openai" (the real openai client, one thread per stream) or "lean" (one asyncio
    loop reading the SSE bytes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "host.daemon", "--port", str(port), "--driver", driver, "--log-level", "warning"]
    command += [f"--driver-arg={a}" for a in driver_args] + ["--max-concurrent-runs", str(max(64, streams))]
    with tempfile.TemporaryDirectory() as data_dir:
        daemon = subprocess.Popen([*command, "--data-dir", data_dir], stdout=subprocess.DEVNULL)
        try:
            drive = _drive if client == "openai" else _drive_lean
            return drive(f"http://127.0.0.1:{port}/v1", streams, tokens, CpuClock(daemon.pid))
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)


def _warm(client: openai.OpenAI) -> str:
    """Wait for the daemon to serve, warm it with one short request; the served model's name."""
    deadline = time.monotonic() + 600
    while True:
        try:
            served = client.models.list().data[0].id
            break
        except (openai.APIError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    client.chat.completions.create(model=served, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return served


def _drive(base_url: str, streams: int, tokens: int, clock: CpuClock) -> dict[str, float]:
    client = openai.OpenAI(api_key="none", base_url=base_url, max_retries=0, timeout=600.0)
    served = _warm(client)

    def one(i: int) -> tuple[float, list[float], int]:
        start = time.perf_counter()
        stamps = []
        generated = 0
        stream = client.chat.completions.create(
            model=served,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=tokens,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                generated = chunk.usage.completion_tokens
            delta = chunk.choices[0].delta if chunk.choices else None
            # Token chunks only: not the opening role chunk, not the closing finish chunk.
            if delta is not None and delta.role is None and chunk.choices[0].finish_reason is None:
                stamps.append(time.perf_counter())
        return start, stamps, generated

    cpu0 = clock.read()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        results = list(pool.map(one, range(streams)))
    wall = time.perf_counter() - t0
    cpu = clock.since(cpu0)
    client.close()
    return summarize([r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results), wall, cpu)


def _drive_lean(base_url: str, streams: int, tokens: int, clock: CpuClock) -> dict[str, float]:
    """The same requests from one asyncio loop over raw HTTP/1.1: no pydantic, no threads, so the
    client takes little of the CPU the daemon shares with it here (a deployment's clients run on
    other machines). Each stream is checked: every event parses, the last chunk says "length",
    and `usage` says it generated `tokens` tokens."""
    with openai.OpenAI(api_key="none", base_url=base_url, max_retries=0, timeout=600.0) as client:
        served = _warm(client)
    return asyncio.run(_lean_streams(base_url, served, streams, tokens, clock))


async def _lean_streams(base_url: str, served: str, streams: int, tokens: int, clock: CpuClock) -> dict[str, float]:
    address, _, path = base_url.removeprefix("http://").partition("/")
    host, _, port = address.partition(":")
    cpu0 = clock.read()
    t0 = time.perf_counter()
    jobs = (_lean_stream(host, int(port), f"/{path}/chat/completions", served, i, tokens) for i in range(streams))
    results = await asyncio.gather(*jobs)
    wall = time.perf_counter() - t0
    cpu = clock.since(cpu0)
    return summarize([r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results), wall, cpu)


async def _lean_stream(
    host: str, port: int, path: str, served: str, seed: int, tokens: int
) -> tuple[float, list[float], int]:
    body = json.dumps(
        {
            "model": served,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": tokens,
            "seed": seed,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head.encode() + body)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"stream {seed}: {status.decode().strip()}: {await reader.read(2000)!r}")
    headers = (await reader.readuntil(b"\r\n\r\n")).lower()
    if b"transfer-encoding: chunked" not in headers:
        raise RuntimeError(f"stream {seed}: expected a chunked response, got headers {headers!r}")
    stamps: list[float] = []
    usage: dict[str, int] = {}
    finish: str | None = None
    pending = b""
    while True:  # chunked transfer coding: a hex size line, the bytes, CRLF; size 0 ends it
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            break
        pending += (await reader.readexactly(size + 2))[:-2]
        *events, pending = pending.split(b"\n\n")
        now = time.perf_counter()
        for event in events:
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream {seed} failed: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
                # Token chunks only, as `_drive` counts them: not the role chunk, not the finish.
                if choice["finish_reason"] is None and "role" not in choice["delta"]:
                    stamps.append(now)
    writer.close()
    if finish != "length" or usage.get("completion_tokens") != tokens:
        raise RuntimeError(f"stream {seed} ended with finish_reason {finish!r} and usage {usage}, not {tokens} tokens")
    return start, stamps, usage["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--smollm2", action="store_true", help="the torch driver with SmolLM2 instead of the dummy")
    parser.add_argument("--driver-args", default="--dtype float32", help="with --smollm2: the torch driver's options")
    parser.add_argument("--repeat", type=int, default=3, help="alternated runs of every side; medians are shown")
    parser.add_argument("--out", default="bench/results/serve.json")
    args = parser.parse_args()
    if args.smollm2:
        driver, driver_args, model = "torch", args.driver_args.split(), "SmolLM2"
    else:
        driver, driver_args, model = "dummy", ["--pass-latency-ms", str(args.latency_ms)], "dummy"
    sides: dict[str, Callable[[], dict[str, float]]] = {
        "in-process": lambda: in_process(driver, driver_args, args.streams, args.tokens, model),
        **{
            f"HTTP, {client} client": functools.partial(
                over_http, driver, driver_args, args.streams, args.tokens, model, client
            )
            for client in CLIENTS
        },
    }
    load_at_start = os.getloadavg()
    runs: list[dict[str, dict[str, float]]] = []
    for rep in range(args.repeat):  # alternated and rotated, so every side sees the same neighbours
        names = list(sides)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        run = {}
        for name in names:
            log(f"[{rep + 1}/{args.repeat}] {args.streams} streams x {args.tokens} tokens on {model}: {name} ...")
            run[name] = sides[name]()
        runs.append(run)
    load = os.getloadavg()
    median = {name: {key: statistics.median(run[name][key] for run in runs) for key in runs[0][name]} for name in sides}
    print(
        f"{args.streams} concurrent streams x {args.tokens} tokens, {model}"
        + (f" ({args.driver_args})" if args.smollm2 else f" (pass latency {args.latency_ms} ms)")
        + f"; medians of {args.repeat} alternated runs; load average (1, 5, 15 min) "
        + f"{' '.join(f'{x:.2f}' for x in load_at_start)} at the start, {' '.join(f'{x:.2f}' for x in load)} at the end"
    )
    print(
        f"{'':<20} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8} "
        f"{'host cpu s':>10} {'client cpu s':>12}"
    )
    for name, r in median.items():
        print(
            f"{name:<20} {r['tokens_per_s']:>8.0f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} "
            f"{r['itl_p50_ms']:>8.1f} {r['itl_p99_ms']:>8.1f} {r['host_cpu_s']:>10.2f} {r['client_cpu_s']:>12.2f}"
        )
    overheads: dict[str, dict[str, Any]] = {}
    for client in CLIENTS:
        name = f"HTTP, {client} client"
        # Each run's HTTP side against the in-process side of the same run.
        per_run = sorted(1 - run[name]["tokens_per_s"] / run["in-process"]["tokens_per_s"] for run in runs)
        met = statistics.median(per_run) <= 0.10
        overheads[client] = {"median": statistics.median(per_run), "per_run": per_run, "target_met": met}
        print(
            f"HTTP throughput overhead, {client} client: median {statistics.median(per_run):.1%} "
            f"(runs: {', '.join(f'{o:.1%}' for o in per_run)}); "
            f"target (at most 10% at 32 streams): {'met' if met else 'NOT met'}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"streams": args.streams, "tokens": args.tokens, "model": model,
                              "load_average": {"start": load_at_start, "end": load}, "medians": median,
                              "overhead": overheads, "runs": runs}  # fmt: skip
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
