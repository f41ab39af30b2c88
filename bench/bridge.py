"""Bridge benchmark: codec time and Unix-socket round trip, side by side with a naive encoding.

For decode passes of 1, 16, 64 and 256 requests and for 4k and 16k-token prefills: encode and
decode time of wafer's codec (binary arrays, zero-copy decode, full validation) next to a naive
msgpack encoding of the same batch as lists of ints, frame sizes, and the p50/p90 round trip
through a real dummy driver over a Unix socket. Prints a table, writes JSON.

    python bench/bridge.py [--repeats N] [--out bench/results/bridge.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward
from bridge_schema.client import Client
from bridge_schema.codec import decode, encode
from bridge_schema.limits import Limits
from bridge_schema.messages import Ack, Forward, ForwardResult, Hello, Shutdown
from bridge_schema.transport import connect, run

PAGE = 16


def decode_pass(n: int) -> Forward:
    """n contexts of ~120 tokens each, one new token and one seeded sampled row each."""
    specs = [
        RequestSpec(
            context_id=i,
            tokens=[(i * 7) % 256],
            positions=[120],
            pages=list(range(i * 8, i * 8 + 8)),
            last_page_len=121 - 7 * PAGE,
            outputs=[OutputSpec(0, Sampler.random(0.8, top_p=0.95, seed=i))],
        )
        for i in range(n)
    ]
    return build_forward(1, specs)


def prefill_pass(n_tokens: int) -> Forward:
    spec = RequestSpec(
        context_id=0,
        tokens=np.arange(n_tokens, dtype=np.uint32) % 256,
        positions=np.arange(n_tokens, dtype=np.uint32),
        pages=np.arange(n_tokens // PAGE, dtype=np.uint32),
        last_page_len=PAGE,
        outputs=[OutputSpec(n_tokens - 1)],
    )
    return build_forward(1, [spec])


def naive_encode(f: Forward) -> bytes:
    body = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in dataclasses.asdict(f).items()}
    return msgpack.packb(body)  # type: ignore[no-any-return]


def naive_decode(payload: bytes) -> dict[str, Any]:
    body = msgpack.unpackb(payload)
    return {k: (np.array(v) if isinstance(v, list) else v) for k, v in body.items()}


def timeit_us(fn: Callable[[], object], repeats: int) -> float:
    """Median of `repeats` timings, in microseconds."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


async def round_trips(address: str, cases: dict[str, Forward], repeats: int) -> dict[str, tuple[float, float]]:
    out = {}
    async with Client.open(await connect(address)) as client:
        await client.hello(Hello(page_size=PAGE, num_pages=8192))
        for name, f in cases.items():
            samples = []
            for i in range(repeats + 20):
                t0 = time.perf_counter()
                await client.request(f, ForwardResult)
                if i >= 20:  # warm-up
                    samples.append((time.perf_counter() - t0) * 1e6)
            samples.sort()
            out[name] = (samples[len(samples) // 2], samples[int(len(samples) * 0.9)])
            print(f"  round trip {name}: p50 {out[name][0]:.0f} us", file=sys.stderr)
        await client.request(Shutdown(), Ack)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", default="bench/results/bridge.json")
    args = parser.parse_args()
    cases = {f"decode x{n}": decode_pass(n) for n in (1, 16, 64, 256)}
    cases |= {"prefill 4k": prefill_pass(4096), "prefill 16k": prefill_pass(16384)}
    limits = Limits(256, PAGE, 8192, 32768, 256, 32768, 1 << 26, 20)
    rows = []
    for name, f in cases.items():
        print(f"codec {name} ...", file=sys.stderr)
        payload, naive = encode(f), naive_encode(f)
        rows.append(
            {
                "case": name,
                "bytes": len(payload),
                "encode_us": timeit_us(lambda f=f: encode(f), args.repeats),
                "decode_us": timeit_us(lambda p=payload: decode(p, limits), args.repeats),
                "naive_bytes": len(naive),
                "naive_encode_us": timeit_us(lambda f=f: naive_encode(f), args.repeats),
                "naive_decode_us": timeit_us(lambda p=naive: naive_decode(p), args.repeats),
            }
        )
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "dummy.sock"
        driver = subprocess.Popen(
            [sys.executable, "-m", "drivers.dummy", "--listen", f"unix:{sock}", "--log-level", "WARNING"]
        )
        while not sock.exists():
            time.sleep(0.02)
        print("round trips through the dummy driver over a Unix socket ...", file=sys.stderr)
        rtt = run(round_trips, f"unix:{sock}", cases, args.repeats)
        driver.wait(timeout=30)
    for row in rows:
        row["rtt_p50_us"], row["rtt_p90_us"] = rtt[row["case"]]
        row["codec_us"] = row["encode_us"] + row["decode_us"]
        row["naive_codec_us"] = row["naive_encode_us"] + row["naive_decode_us"]
    header = (
        f"{'case':<13} {'frame B':>9} {'enc us':>8} {'dec us':>8} {'enc+dec':>8} "
        f"{'naive B':>9} {'naive e+d':>10} {'speedup':>8} {'rtt p50':>8} {'rtt p90':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<13} {r['bytes']:>9} {r['encode_us']:>8.1f} {r['decode_us']:>8.1f} {r['codec_us']:>8.1f} "
            f"{r['naive_bytes']:>9} {r['naive_codec_us']:>10.1f} {r['naive_codec_us'] / r['codec_us']:>7.1f}x "
            f"{r['rtt_p50_us']:>8.0f} {r['rtt_p90_us']:>8.0f}"
        )
    targets = {
        "decode x64 round trip p50 <= 300 us": rtt["decode x64"][0] <= 300,
        "prefill 16k encode+decode <= 1000 us": next(r for r in rows if r["case"] == "prefill 16k")["codec_us"] <= 1000,
    }
    for target, met in targets.items():
        print(f"target: {target}: {'met' if met else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "targets": targets, "repeats": args.repeats}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
