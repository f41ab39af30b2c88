"""A tensor-parallel torch driver. Rank 0 serves the bridge through `TensorParallelDriver`: each
operation is checked and run on rank 0's shard first (a bad request is refused before any other
rank sees it), broadcast, and run by every rank on its own shard; only rank 0 samples and replies.
Ranks 1..N-1 run `follow`. The host sees one driver."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from bridge_schema.messages import Adapter, Copy, Forward, ForwardResult, Handshake, Hello
from drivers.errors import ConfigRejected
from drivers.torch.checkpoint import Checkpoint
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.lora import load_peft
from drivers.torch.rank_group import RankGroup
from drivers.torch.tensor_parallel import check_tensor_parallel, shard_checkpoint, shard_lora

log = logging.getLogger(__name__)


def check_options(ckpt: Checkpoint, options: DriverOptions, num_ranks: int) -> None:
    """What a tensor-parallel group can run: raises `ConfigRejected` before any rank starts."""
    check_tensor_parallel(ckpt.cfg, num_ranks)
    if options.weights != "dense":
        raise ConfigRejected(f"tensor parallelism runs dense weights only, not {options.weights!r}", "weights")
    if options.compile:
        raise ConfigRejected("tensor parallelism does not run the compiled path (--compile)", "compile")


def scatter_shards(ckpt: Checkpoint, options: DriverOptions, group: RankGroup) -> TorchDriver:
    """Rank 0: shard the checkpoint it loaded, send ranks 1..N-1 theirs (they never read the
    model file, and hold only their share), and build its own driver."""
    check_options(ckpt, options, group.num_ranks)
    for rank in range(1, group.num_ranks):
        shard = shard_checkpoint(ckpt, rank, group.num_ranks)
        group.send(dataclasses.replace(shard, tokenizer=None), rank)
        del shard
    return build_rank_driver(shard_checkpoint(ckpt, 0, group.num_ranks), options, group)


def build_rank_driver(shard: Checkpoint, options: DriverOptions, group: RankGroup) -> TorchDriver:
    """This rank's driver: an ordinary `TorchDriver` over its shard, whose model sums the
    row-parallel projections over the group."""
    driver = TorchDriver(shard, options)
    driver.model.reduce = group.reduce
    return driver


def _apply_adapter(driver: TorchDriver, request: Adapter, group: RankGroup) -> None:
    if request.op == "load":
        weights = load_peft(Path(request.path), driver.cfg.num_layers, driver.dtype, driver.device)
        driver.adapters[request.adapter_id] = shard_lora(weights, group.rank, group.num_ranks)
    else:
        driver.adapter(request)  # unload, or the error a bad op gets


class TensorParallelDriver:
    """Rank 0's `Driver`: the bridge's view of the whole group."""

    def __init__(self, driver: TorchDriver, group: RankGroup) -> None:
        assert group.rank == 0
        self.driver = driver
        self.group = group
        self.ckpt = driver.ckpt

    def _info(self) -> dict[str, int | float | str]:
        return {"tensor_parallel": self.group.num_ranks, "tensor_parallel_backend": self.group.backend}

    def handshake(self, hello: Hello) -> Handshake:
        reply = self.driver.handshake(hello)
        self.group.broadcast(("hello", hello))
        reply.driver_info = {**reply.driver_info, **self._info()}
        return reply

    @torch.inference_mode()
    def forward(self, request: Forward) -> ForwardResult:
        start = time.perf_counter()
        plan, lora = self.driver.plan_pass(request)
        self.group.broadcast(("forward", request))
        logits = self.driver.run_model(plan, lora, plan.out_tokens)
        return self.driver.sample_pass(request, plan, logits, start)

    def copy(self, request: Copy) -> None:
        self.driver.copy(request)
        self.group.broadcast(("copy", request))

    def adapter(self, request: Adapter) -> None:
        _apply_adapter(self.driver, request, self.group)
        self.group.broadcast(("adapter", request))

    def health(self) -> dict[str, int | float | str]:
        pids = ",".join(str(p) for p in self.group.pids)
        return {**self.driver.health(), **self._info(), "tensor_parallel_pids": pids}

    def faster_configuration(self) -> str:
        return ""

    def close(self) -> None:
        self.group.stop()


@torch.inference_mode()
def follow(driver: TorchDriver, group: RankGroup) -> None:
    """Ranks 1..N-1: run each operation rank 0 broadcasts until it sends None. Rank 0 accepted the
    operation on its own shard first, so a failure here is this rank's own: it ends the process
    (and rank 0 then stops the driver) rather than leave the group out of step."""
    rows = torch.zeros(0, dtype=torch.long, device=driver.device)  # rank 0 alone needs logits
    while (op := group.broadcast()) is not None:
        assert isinstance(op, tuple)
        kind, message = op
        if kind == "hello":
            driver.handshake(message)
        elif kind == "forward":
            plan, lora = driver.plan_pass(message)
            driver.run_model(plan, lora, rows)
        elif kind == "copy":
            driver.copy(message)
        elif kind == "adapter":
            _apply_adapter(driver, message, group)
        else:
            raise AssertionError(f"unknown tensor-parallel operation {kind!r}")
