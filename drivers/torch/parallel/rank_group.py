"""The processes and collectives of one tensor-parallel group. Rank 0 (the process that serves the
bridge) starts ranks 1..N-1 as its children, meets them at a TCPStore on a free loopback port,
watches them, and broadcasts each operation to them. Knows processes and torch.distributed; knows
nothing of models or the bridge's messages."""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from drivers.errors import ConfigRejected

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
# A rank waits for the next operation on the control group for as long as the driver sits idle,
# so its timeout is long; a rank that dies is seen at once (its sockets close; `_watch` below).
_IDLE_TIMEOUT = datetime.timedelta(days=365)
_PR_SET_PDEATHSIG = 1


class RankGroup:
    """One rank's view of the group: `reduce` sums a tensor over ranks and `max` takes its maximum
    (the compute group: NCCL on CUDA, gloo on the CPU); `broadcast` sends rank 0's operation to
    every rank (always gloo)."""

    def __init__(self, rank: int, num_ranks: int, backend: str, workers: Sequence[subprocess.Popen[bytes]] = ()):
        self.rank = rank
        self.num_ranks = num_ranks
        self.backend = backend
        self._workers = list(workers)
        self._control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        self._stopping = threading.Event()
        if self._workers:
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [os.getpid(), *(p.pid for p in self._workers)]

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `t` over ranks, as a new tensor (`t` may be an inference
        tensor, which cannot be written in place outside inference mode)."""
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    def broadcast(self, op: object = None) -> object:
        """Rank 0: send `op` (None = stop) to every rank. Other ranks: the op rank 0 sent."""
        box = [op]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def send(self, obj: object, rank: int) -> None:
        """Rank 0: send `obj` (pickled; tensors by value) to one rank, which `receive`s it."""
        dist.send_object_list([obj], dst=rank, group=self._control)

    def receive(self) -> object:
        box: list[object] = [None]
        dist.recv_object_list(box, src=0, group=self._control)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self._control)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Rank 0: tell every rank to exit, wait for them, then leave the group."""
        self._stopping.set()
        if self.rank == 0:
            self.broadcast(None)
        deadline = time.monotonic() + timeout_s
        for p in self._workers:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        dist.destroy_process_group()

    def _watch(self) -> None:
        """Rank 0: a rank that exits while the group serves stops the driver (its supervisor then
        restarts it): a group missing a rank cannot run a pass, and waiting for it would hang."""
        while not self._stopping.wait(0.1):
            for rank, p in enumerate(self._workers, start=1):
                status = p.poll()
                if status is not None and not self._stopping.is_set():
                    print(
                        f"[wafer torch] tensor-parallel rank {rank} (pid {p.pid}) exited with status {status}: "
                        "the driver stops",
                        file=sys.stderr,
                        flush=True,
                    )
                    for other in self._workers:
                        if other.poll() is None:
                            other.kill()
                    os._exit(1)


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the CPU, or the r-th CUDA device after the one named (cuda = cuda:0)."""
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL this process when its parent dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed sockets still end the rank
        pass


def start_group(num_ranks: int, device: str, worker_argv: Sequence[str], timeout_s: float) -> RankGroup:
    """Rank 0: start ranks 1..N-1 (`python -m drivers.torch *worker_argv --tp-rank R ...`), join them."""
    if device.startswith("cuda"):
        if torch.cuda.device_count() < num_ranks + int(device.partition(":")[2] or 0):
            raise ConfigRejected(
                f"{num_ranks} ranks need {num_ranks} CUDA devices from {device}; {torch.cuda.device_count()} visible",
                "tensor_parallel",
            )
        torch.cuda.set_device(rank_device(device, 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOOPBACK, 0, num_ranks, is_master=True, timeout=timeout, wait_for_workers=False)
    workers = []
    for rank in range(1, num_ranks):
        argv = [*worker_argv, "--tp-rank", str(rank), "--tp-store", f"{LOOPBACK}:{store.port}"]
        argv += ["--tp-parent", str(os.getpid())]
        workers.append(subprocess.Popen([sys.executable, "-m", "drivers.torch", *argv], preexec_fn=_die_with_parent))
    try:
        dist.init_process_group(_backend(device), store=store, rank=0, world_size=num_ranks, timeout=timeout)
        return RankGroup(0, num_ranks, _backend(device), workers)
    except BaseException:
        for p in workers:
            p.kill()
        raise


def join_group(
    rank: int, num_ranks: int, device: str, store_address: str, parent_pid: int, timeout_s: float
) -> RankGroup:
    """Rank 1..N-1: meet rank 0 at its store. SIGINT is left to rank 0, which stops the group."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent_pid:  # rank 0 died before this rank could ask to die with it
        raise SystemExit(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(rank_device(device, rank))
    host, _, port = store_address.rpartition(":")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), num_ranks, is_master=False, timeout=timeout)
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=num_ranks, timeout=timeout)
    return RankGroup(rank, num_ranks, _backend(device))
