"""Start the dummy driver and drive it through the bridge: handshake, a prefill, a few decode
steps with a logit mask, a page copy, health. What `make run` shows until the host lands."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward, pack_allowed, split_result
from bridge_schema.client import Client
from bridge_schema.messages import Ack, Copy, ForwardResult, Health, HealthReply, Hello, Shutdown
from bridge_schema.transport import connect


async def drive(address: str) -> None:
    async with Client.open(await connect(address)) as client:
        hs = await client.hello(Hello(page_size=4))
        print(f"handshake: driver={hs.driver_kind} vocab={hs.vocab_size} page_size={hs.page_size} pages={hs.num_pages}")
        prompt = list(b"Hello, wafer!")
        pages, length = list(range(8)), len(prompt)
        lowercase = pack_allowed(hs.vocab_size, list(range(ord("a"), ord("z") + 1)))
        tokens: list[int] = []
        step_tokens, step_positions = prompt, list(range(length))
        for step in range(16):
            used_pages = pages[: (length + hs.page_size - 1) // hs.page_size]
            spec = RequestSpec(
                context_id=1,
                tokens=step_tokens,
                positions=step_positions,
                pages=used_pages,
                last_page_len=length - (len(used_pages) - 1) * hs.page_size,
                outputs=[OutputSpec(len(step_tokens) - 1, Sampler.random(seed=7), logit_mask=lowercase)],
            )
            forward = build_forward(0, [spec])
            t0 = time.perf_counter()
            result = await client.request(forward, ForwardResult)
            dt_us = (time.perf_counter() - t0) * 1e6
            token = split_result(forward, result)[0][0].token
            tokens.append(token)
            print(
                f"step {step:2d}: {len(step_tokens):2d} token(s) in, "
                f"sampled {token:3d} {chr(token)!r}  ({dt_us:.0f} us)"
            )
            step_tokens, step_positions = [token], [length]
            length += 1
        print("generated (lowercase only, by logit mask):", bytes(tokens).decode())
        await client.request(Copy(src_pages=[0], dst_pages=[9]), Ack)  # type: ignore[arg-type]
        health = await client.request(Health(), HealthReply)
        print("driver health:", health.state, health.stats)
        await client.request(Shutdown(), Ack)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix:{Path(tmp) / 'dummy.sock'}"
        print(f"starting: python -m drivers.dummy --listen {address}")
        driver = subprocess.Popen(
            [sys.executable, "-m", "drivers.dummy", "--listen", address, "--log-level", "WARNING"]
        )
        try:
            for _ in range(100):
                if (Path(tmp) / "dummy.sock").exists():
                    break
                time.sleep(0.05)
            anyio.run(drive, address)
        finally:
            try:
                driver.wait(timeout=10)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait()
        print(f"driver exited with status {driver.returncode}")


if __name__ == "__main__":
    main()
