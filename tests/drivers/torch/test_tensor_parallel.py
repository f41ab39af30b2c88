"""Tensor parallelism through the real bridge: `python -m drivers.torch --tensor-parallel N` (N
processes on gloo) served on a Unix socket gives the tokens and log-probabilities of one
in-process `TorchDriver` over the whole model (within 1e-4, fp32), for prefill in chunks, decode,
a user attention mask, sliding windows, sampling, Copy and LoRA (the bridge carries each output
row's logits as its full log-probability vector, compared whole); SmolLM2 (9 heads, 3 KV heads)
at TP 3 likewise; a bad request is refused on rank 0 and the group keeps serving; a bad N is
refused at start; a rank that dies stops the driver, and the other ranks die with rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from bridge_schema.batch import OutputSpec, Sampler
from bridge_schema.client import Client
from bridge_schema.errors import RemoteError
from bridge_schema.messages import (
    Ack,
    Adapter,
    Copy,
    Forward,
    ForwardResult,
    Health,
    HealthReply,
    Hello,
    Message,
    Probe,
    Status,
)
from bridge_schema.transport import connect
from drivers.errors import ConfigRejected
from drivers.torch.checkpoint import Checkpoint
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.tensor_parallel import check_tensor_parallel, shard_checkpoint
from tests.drivers.torch.helpers import (
    GREEDY,
    brle,
    forward,
    load_dir,
    random_tokens,
    request,
    write_adapter,
    write_tiny_gemma,
    write_tiny_llama,
)

PAGE_SIZE = 4
Run = Callable[[Message], Message]


# ---------------------------------------------------------------- the driver under test


@contextmanager
def serving(model: str, num_ranks: int, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """`python -m drivers.torch --tensor-parallel N` on a Unix socket: (address, rank 0, its stderr)."""
    sock, log = tmp_path / f"tp{num_ranks}.sock", tmp_path / f"tp{num_ranks}.log"
    cmd = [sys.executable, "-m", "drivers.torch", "--model", model, "--threads", "1"]
    cmd += ["--tensor-parallel", str(num_ranks), "--listen", f"unix:{sock}", "--log-level", "WARNING"]
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"TP driver did not start (status {proc.poll()}): {log.read_text()[-2000:]}")
        time.sleep(0.05)
    try:
        yield f"unix:{sock}", proc, log
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def over_bridge(address: str, scenario: Callable[[Run], list[ForwardResult]]) -> tuple[list[ForwardResult], dict]:
    """Run `scenario` (synchronous: it runs in-process too) against the driver at `address`, from
    a worker thread; its results and the driver's health stats."""

    async def main() -> tuple[list[ForwardResult], dict]:
        async with Client.open(await connect(address)) as client:

            async def send(msg: Message) -> Message:
                if isinstance(msg, Hello):
                    return await client.hello(msg)
                return await client.request(msg, ForwardResult if isinstance(msg, Forward) else Ack)

            def run(msg: Message) -> Message:
                return anyio.from_thread.run(send, msg)

            results = await anyio.to_thread.run_sync(scenario, run)
            health = await client.request(Health(), HealthReply)
            return results, dict(health.stats)

    return anyio.run(main)


def in_process(ckpt: Checkpoint, scenario: Callable[[Run], list[ForwardResult]]) -> list[ForwardResult]:
    """The reference: one `TorchDriver` over the whole model, same options as the served one."""
    drv = TorchDriver(ckpt, DriverOptions())

    def run(msg: Message) -> Message:
        if isinstance(msg, Hello):
            return drv.handshake(msg)
        if isinstance(msg, Forward):
            return drv.forward(msg)
        if isinstance(msg, Copy):
            drv.copy(msg)
        elif isinstance(msg, Adapter):
            drv.adapter(msg)
        return Ack()

    return scenario(run)


def assert_same(ours: list[ForwardResult], ref: list[ForwardResult], atol: float) -> None:
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.tokens.tolist() == b.tokens.tolist(), f"pass {i}: tokens differ"
        assert a.dist_indptr.tolist() == b.dist_indptr.tolist()
        got, want = torch.tensor(a.dists), torch.tensor(b.dists)
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, i=i: f"pass {i}: {m}")


# ---------------------------------------------------------------- what both sides run


def _dist_rows(n: int, sampler: Sampler = GREEDY) -> list[OutputSpec]:
    return [OutputSpec(row=r, sampler=sampler, probe=Probe.DISTRIBUTION) for r in range(n)]


def _pages(context: int) -> list[int]:
    return list(range(8 * context, 8 * context + 8))


def feature_scenario(adapter: Path) -> Callable[[Run], list[ForwardResult]]:
    """Chunked prefill batched with a masked request, greedy decode, Copy then decode from both
    copies, LoRA next to the base model, seeded and unseeded sampling, adapter unload."""
    prompt = random_tokens(13, 96, seed=1)

    def scenario(run: Run) -> list[ForwardResult]:
        out: list[ForwardResult] = []

        def fwd(*specs: object) -> ForwardResult:
            reply = run(forward(list(specs)))  # type: ignore[arg-type]
            assert isinstance(reply, ForwardResult)
            out.append(reply)
            return reply

        run(Hello(page_size=PAGE_SIZE, num_pages=48))
        run(Adapter(op="load", adapter_id=1, path=str(adapter)))
        fwd(request(prompt[:5], 0, _pages(0), PAGE_SIZE, outputs=_dist_rows(5)))
        masked = [brle([k % 3 != 1 or k == q for k in range(6)]) for q in range(6)]  # every 3rd key hidden
        second = request(prompt[5:], 5, _pages(0), PAGE_SIZE, outputs=_dist_rows(8))
        fwd(second, request(prompt[:6], 0, _pages(1), PAGE_SIZE, context_id=1, mask_rows=masked, outputs=_dist_rows(6)))
        seq, row = list(prompt), 7  # context 0's last row in that pass
        for _ in range(4):  # greedy decode, each step from the token this side sampled
            seq.append(int(out[-1].tokens[row]))
            fwd(request(seq[-1:], len(seq) - 1, _pages(0), PAGE_SIZE, outputs=_dist_rows(1)))
            row = 0
        used = -(-len(seq) // PAGE_SIZE)  # context 0 now holds 17 tokens on 5 pages, the last partial
        run(Copy(src_pages=np.array(_pages(0)[:used], np.uint32), dst_pages=np.array(_pages(2)[:used], np.uint32)))
        nxt = int(out[-1].tokens[0])
        both = fwd(
            request([nxt], len(seq), _pages(0), PAGE_SIZE, outputs=_dist_rows(1)),
            request([nxt], len(seq), _pages(2), PAGE_SIZE, context_id=2, outputs=_dist_rows(1)),
        )
        original, copied = np.split(both.dists, 2)
        np.testing.assert_array_equal(original, copied)  # the copy holds context 0's KV on every rank
        lora_prompt = random_tokens(7, 96, seed=2)
        fwd(
            request(lora_prompt, 0, _pages(3), PAGE_SIZE, context_id=3, adapter_id=1, outputs=_dist_rows(7)),
            request(lora_prompt, 0, _pages(4), PAGE_SIZE, context_id=4, outputs=_dist_rows(7)),
        )
        sampled = [Sampler.random(0.8, top_k=20, seed=7), Sampler.random(1.0, top_p=0.9)]
        fwd(request(lora_prompt[:3], 0, _pages(5), PAGE_SIZE, context_id=5, outputs=_dist_rows(3, sampled[0])))
        fwd(request(lora_prompt[:3], 0, _pages(5), PAGE_SIZE, context_id=5, outputs=_dist_rows(3, sampled[1])))
        run(Adapter(op="unload", adapter_id=1))
        return out

    return scenario


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("family", ["llama", "gemma-window4"])
def test_tp2_equals_tp1_through_the_bridge(tmp_path: Path, family: str) -> None:
    """4 heads / 2 KV heads over 2 ranks: 2 heads and 1 KV head each. Gemma alternates windowed
    (4) and full layers, so the 13-token prefill's chunks (5, 8) are shorter and longer than it."""
    if family == "llama":
        path = write_tiny_llama(tmp_path / "m")
    else:
        path = write_tiny_gemma(tmp_path / "m", sliding_window=4)
    ckpt = load_dir(path)
    write_adapter(tmp_path / "lora", ckpt, seed=3)
    scenario = feature_scenario(tmp_path / "lora")
    ref = in_process(ckpt, scenario)
    with serving(str(path), 2, tmp_path) as (address, rank0, log):
        ours, health = over_bridge(address, scenario)
        assert health["tensor_parallel"] == 2 and health["tensor_parallel_backend"] == "gloo"
        pids = [int(p) for p in str(health["tensor_parallel_pids"]).split(",")]
        assert pids[0] == rank0.pid and len(pids) == 2
        assert_same(ours, ref, atol=1e-4)
        if family == "llama":
            anyio.run(_refused_then_served, address)  # a rank that dies stops the driver instead of hanging it
            os.kill(pids[1], signal.SIGKILL)
            assert rank0.wait(timeout=30) != 0
            assert f"tensor-parallel rank 1 (pid {pids[1]}) exited" in log.read_text()
        else:  # the other ranks die with rank 0
            os.kill(rank0.pid, signal.SIGKILL)
            rank0.wait(timeout=10)
            deadline = time.monotonic() + 30
            while _alive(pids[1]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(pids[1])


async def _refused_then_served(address: str) -> None:
    """A request rank 0 refuses reaches no other rank: the group stays in step and serves on."""
    async with Client.open(await connect(address)) as client:
        await client.hello(Hello(page_size=PAGE_SIZE, num_pages=48))
        bad = forward([request([5, 6, 7], 0, _pages(5), PAGE_SIZE, adapter_id=9)])
        with pytest.raises(RemoteError) as err:
            await client.request(bad, ForwardResult)
        assert err.value.status == Status.OUT_OF_RANGE and err.value.field == "adapter_ids"
        good = await client.request(forward([request([5, 6, 7], 0, _pages(5), PAGE_SIZE)]), ForwardResult)
        assert len(good.tokens) == 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


SMOLLM2_PROMPT = "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"
SMOLLM2_ATOL = 2e-4  # log-probabilities over 49,152 tokens after 30 layers summed in another order; 6e-5 measured


def smollm2_scenario(prompt: list[int], num_new: int) -> Callable[[Run], list[ForwardResult]]:
    def scenario(run: Run) -> list[ForwardResult]:
        run(Hello(page_size=16, num_pages=8))
        pages, seq, out = list(range(8)), list(prompt), []
        reply = run(forward([request(seq, 0, pages, 16, outputs=_dist_rows(len(seq))[-1:])]))
        for _ in range(num_new):
            assert isinstance(reply, ForwardResult)
            out.append(reply)
            seq.append(int(reply.tokens[0]))
            reply = run(forward([request(seq[-1:], len(seq) - 1, pages, 16, outputs=_dist_rows(1))]))
        return out

    return scenario


def test_smollm2_tp3_equals_tp1(smollm2: Checkpoint, tmp_path: Path) -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads, 3 heads and 1 KV head per rank."""
    assert smollm2.tokenizer is not None
    scenario = smollm2_scenario(smollm2.tokenizer.encode(SMOLLM2_PROMPT).ids, 8)
    ref = in_process(smollm2, scenario)
    with serving("smollm2", 3, tmp_path) as (address, _, _):
        ours, health = over_bridge(address, scenario)
    assert health["tensor_parallel"] == 3
    assert_same(ours, ref, atol=SMOLLM2_ATOL)
    text = smollm2.tokenizer.decode([int(r.tokens[0]) for r in ours])
    assert text.strip(), "greedy output is empty"


def test_a_rank_count_that_does_not_divide_the_kv_heads_is_refused(smollm2: Checkpoint, tmp_path: Path) -> None:
    with pytest.raises(ConfigRejected, match="2 ranks do not divide the model's 3 KV heads"):
        check_tensor_parallel(smollm2.cfg, 2)
    path = write_tiny_llama(tmp_path / "m")  # 2 KV heads
    cmd = [sys.executable, "-m", "drivers.torch", "--model", str(path), "--tensor-parallel", "3"]
    done = subprocess.run([*cmd, "--listen", f"unix:{tmp_path / 's'}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "3 ranks do not divide the model's 2 KV heads (4 heads, 2 KV heads)" in done.stderr


def test_shards_split_heads_and_mlp_columns_and_replicate_the_rest(tmp_path: Path) -> None:
    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    parts = [shard_checkpoint(ckpt, r, 2) for r in range(2)]
    assert (parts[0].cfg.num_heads, parts[0].cfg.num_kv_heads, parts[0].cfg.intermediate_size) == (2, 1, 64)
    for key, full in ckpt.state.items():
        got = [p.state[key] for p in parts]
        if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            torch.testing.assert_close(torch.cat(got, 0), full, atol=0, rtol=0)
        elif key.endswith(("o_proj.weight", "down_proj.weight")):
            torch.testing.assert_close(torch.cat(got, 1), full, atol=0, rtol=0)
        else:
            assert all(g is full for g in got), key


def test_tensor_parallel_refuses_weights_it_does_not_shard(tmp_path: Path) -> None:
    from drivers.torch.tp_driver import check_options

    ckpt = load_dir(write_tiny_llama(tmp_path / "m"))
    with pytest.raises(ConfigRejected, match="dense weights only"):
        check_options(ckpt, DriverOptions(dtype="bfloat16", weights="int8"), 2)
    with pytest.raises(ConfigRejected, match="compiled path"):
        check_options(ckpt, DriverOptions(compile=True), 2)
