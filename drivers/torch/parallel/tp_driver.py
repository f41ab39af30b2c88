"""A tensor-parallel torch driver. Rank 0 serves the bridge through `TensorParallelDriver`: each
operation is checked and run on rank 0's shard first (a bad request is refused before any other
rank sees it), broadcast, and run by every rank on its own shard; only rank 0 samples and replies.
Ranks 1..N-1 run `follow`. The host sees one driver. Int8 weights are quantized by each rank on its
own shard; w8a8's smoothing is calibrated over the whole group first (`smoothed_shard`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bridge_schema.messages import Adapter, Copy, Forward, ForwardResult, Handshake, Hello
from drivers.errors import ConfigRejected
from drivers.torch.driver import DTYPES, DriverOptions, TorchDriver, build_model
from drivers.torch.model import Transformer
from drivers.torch.parallel.rank_group import RankGroup
from drivers.torch.parallel.tensor_parallel import check_tensor_parallel, shard_checkpoint, shard_lora
from drivers.torch.weights.checkpoint import Checkpoint
from drivers.torch.weights.fusion import fuse_projections
from drivers.torch.weights.lora import load_peft
from drivers.torch.weights.smoothing import calibration_tokens, cannot_smooth, smooth

log = logging.getLogger(__name__)


def check_options(ckpt: Checkpoint, options: DriverOptions, num_ranks: int) -> None:
    """What a tensor-parallel group can run: raises `ConfigRejected` before any rank starts."""
    check_tensor_parallel(ckpt.cfg, num_ranks)
    if options.weights == "int8" and options.dtype not in ("bfloat16", "float16"):
        # What each rank's `quantize_int8` would refuse, said before any rank starts.
        raise ConfigRejected("int8 weights need --dtype bfloat16 or float16 activations", "weights")


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
    row-parallel projections over the group. Every rank calls this together (w8a8's smoothing
    runs collectives); `TorchDriver` then quantizes the (smoothed) shard as on one rank."""
    if options.weights == "w8a8" and options.smooth and not cannot_smooth(shard.cfg):
        shard = smoothed_shard(shard, options, group)
        options = dataclasses.replace(options, smooth=False)  # done, over the group
    driver = TorchDriver(shard, options)
    driver.model.reduce = group.reduce
    return driver


def smoothed_shard(shard: Checkpoint, options: DriverOptions, group: RankGroup) -> Checkpoint:
    """`shard` with SmoothQuant's factors folded in (`smoothing.py`), as one rank over the whole
    model would fold them: `TorchDriver` smooths before its model can reduce over the group, and a
    shard's calibration pass without the sums would see partial hidden states. So this rank builds
    its float shard, joins the group's calibration pass over rank 0's tokens (ranks 1..N-1 have no
    tokenizer), and keeps the smoothed weights under the checkpoint's names."""
    model = fuse_projections(build_model(shard, torch.device(options.device), DTYPES[options.dtype]))
    model.reduce = group.reduce
    tokens = group.broadcast(calibration_tokens(shard.tokenizer, shard.cfg.vocab_size) if group.rank == 0 else None)
    assert isinstance(tokens, list)
    smooth(model, tokens, max_over_ranks=group.max)
    return dataclasses.replace(shard, state=checkpoint_state(model))


def checkpoint_state(model: Transformer) -> dict[str, torch.Tensor]:
    """A fused model's weights under the checkpoint's names: q/k/v and gate/up split back (views)."""
    cfg = model.cfg
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    parts = {
        ".self_attn.qkv.": (("q_proj", "k_proj", "v_proj"), (q_rows, kv_rows, kv_rows)),
        ".mlp.gate_up.": (("gate_proj", "up_proj"), (cfg.intermediate_size, cfg.intermediate_size)),
    }
    state: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        fused = next((f for f in parts if f in key), None)
        if fused is None:
            state[key] = t
            continue
        names, sizes = parts[fused]
        for name, part in zip(names, t.split(sizes), strict=True):
            state[key.replace(fused, f".{fused.split('.')[1]}.{name}.")] = part
    return state


def _apply_adapter(driver: TorchDriver, request: Adapter, group: RankGroup) -> None:
    if request.op == "load":
        weights = load_peft(Path(request.path), driver.cfg.num_layers, driver.dtype, driver.device)
        driver.adapters[request.adapter_id] = shard_lora(weights, group.rank, group.num_ranks)
    else:
        driver.adapter(request)  # unload, or the error a bad op gets


def _handshake(driver: TorchDriver, hello: Hello, then: Callable[[], None]) -> Handshake:
    """`driver.handshake(hello)`, then `then()` (rank 0: the broadcast), then, with --compile and
    new pages, the warm-up passes that compile the graphs. The warm-up's passes reduce over the
    group, so every rank runs them together once all have their pages; a Hello that rank 0 refuses
    raises before `then`, and no other rank sees it."""
    pages = driver.cache
    reply = driver.handshake(hello, warm_up=False)
    then()
    if driver.compiled is not None and driver.cache is not pages:
        driver.warm_up()  # what a single driver's handshake runs last, here after the broadcast
    return reply


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
        reply = _handshake(self.driver, hello, lambda: self.group.broadcast(("hello", hello)))
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
            _handshake(driver, message, lambda: None)
        elif kind == "forward":
            plan, lora = driver.plan_pass(message)
            driver.run_model(plan, lora, rows)
        elif kind == "copy":
            driver.copy(message)
        elif kind == "adapter":
            _apply_adapter(driver, message, group)
        else:
            raise AssertionError(f"unknown tensor-parallel operation {kind!r}")
