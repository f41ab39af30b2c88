"""Decode passes on CUDA replayed from CUDA graphs. A decode step of a small model issues hundreds
of kernels (25 a layer for SmolLM2) whose launches through Python and the dispatcher take ~10x
the GPU's time; one graph replay launches them all at once.

One graph per bucket of batch sizes (1, 2, 4, ... up to the pass limit), captured on first use
over static inputs: a pass of B decodes (one new token per request, no user mask, no LoRA) is
copied into bucket b >= B's buffers and the rows past B are padding: no keys (kv_len 0), and
their K/V written to a spare slot past the host's pages, so they never touch a context's cache.
Each graph computes all b rows' logits; the pass reads its output rows from them. The same code
runs without capture on the CPU (Triton's interpreter; for tests): `capture=False` calls the
model over the static inputs instead of replaying."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from drivers.torch.batch_plan import PassPlan
from drivers.torch.config import ModelConfig
from drivers.torch.kernels.paged_attention import PagedAttention
from drivers.torch.kv_cache import PagedKVCache
from drivers.torch.model import Transformer

log = logging.getLogger("wafer.torch")


def buckets(max_requests: int) -> list[int]:
    """Batch sizes that get a graph: powers of two, the last one covering `max_requests`."""
    sizes = [1]
    while sizes[-1] < max_requests:
        sizes.append(sizes[-1] * 2)
    return sizes


@dataclass(slots=True)
class _Bucket:
    plan: PassPlan  # static tensors the graph reads
    meta: torch.Tensor  # [3, b] slots, q_slot, kv_len: the views in `plan`
    padding: torch.Tensor  # [3, b] the padding rows' values of `meta`
    logits: torch.Tensor | None = None  # [b, V] the graph's output, once captured
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(
        self,
        cfg: ModelConfig,
        model: Transformer,
        cache: PagedKVCache,
        max_context: int,
        max_requests: int,
        capture: bool = True,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.cache = cache
        self.sizes = buckets(max_requests)
        self.capture = capture
        self.max_pages = -(-max_context // cache.page_size)
        self.buckets: dict[int, _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.passes = 0  # passes served here
        self.disabled = ""  # why graphs are off after a failed capture
        if cfg.num_experts:  # routing reads each expert's token count back to the host: no capture
            self.disabled = "the decode graphs do not take mixture-of-experts blocks"
            log.info("CUDA graphs off: %s", self.disabled)

    def eligible(self, plan: PassPlan) -> bool:
        n = len(plan.num_q_np)
        return (
            not self.disabled
            and 0 < n <= self.sizes[-1]
            and plan.user_mask is None
            and bool(np.all(plan.num_q_np == 1))
            and plan.page_table.shape[1] <= self.max_pages
        )

    def run(self, plan: PassPlan, rows: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(rows), V] of an eligible decode pass (its K/V written), or None."""
        if not self.eligible(plan):
            return None
        n = len(plan.num_q_np)
        size = next(s for s in self.sizes if s >= n)
        bucket = self.buckets.get(size) or self._bucket(size)
        static = bucket.plan
        static.tokens[:n].copy_(plan.tokens)
        static.positions[:n].copy_(plan.positions)
        meta = bucket.meta
        meta[:, n:].copy_(bucket.padding[:, n:])
        meta[0, :n].copy_(plan.slots)
        meta[1, :n].copy_(plan.q_slot)
        meta[2, :n].copy_(plan.kv_len)
        static.page_table[:n, : plan.page_table.shape[1]].copy_(plan.page_table)
        if bucket.logits is None and not self._capture(bucket):
            return None
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.logits = self._forward(bucket)
        self.passes += 1
        assert bucket.logits is not None
        return bucket.logits[rows]

    def _bucket(self, size: int) -> _Bucket:
        from drivers.torch.kernels.attention_triton import BLOCK_M  # imports triton: CUDA (or the interpreter) only

        dev = self.cache.k.device
        arange = torch.arange(size, device=dev)
        meta = torch.zeros(3, size, dtype=torch.long, device=dev)
        padding = torch.zeros_like(meta)
        padding[0] = self.cache.spare_slot
        meta.copy_(padding)
        plan = PassPlan(
            tokens=torch.zeros(size, dtype=torch.long, device=dev),
            positions=torch.zeros(size, dtype=torch.long, device=dev),
            slots=meta[0],
            q_slot=meta[1],
            token_request=arange,
            q_index=arange[:, None],
            q_valid=torch.ones(size, 1, dtype=torch.bool, device=dev),
            kv_len=meta[2],
            num_q=torch.ones(size, dtype=torch.long, device=dev),
            q_start=arange,
            page_table=torch.zeros(size, self.max_pages, dtype=torch.int32, device=dev),
            user_mask=None,
            out_tokens=arange,
            kv_len_np=np.zeros(size, np.int64),
            num_q_np=np.ones(size, np.int64),
            page_table_np=np.zeros((size, self.max_pages), np.int32),
            q_slot_np=np.zeros(size, np.int64),
            q_index_np=np.arange(size)[:, None],
            q_valid_np=np.ones((size, 1), bool),
            out_tokens_np=np.arange(size),
        )
        blocks = torch.stack([arange, arange, arange + 1], dim=1).to(torch.int32)
        plan.query_blocks[BLOCK_M] = blocks
        bucket = _Bucket(plan, meta, padding)
        self.buckets[size] = bucket
        return bucket

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        plan = bucket.plan
        attend = PagedAttention(self.cfg, self.cache, plan, use_triton=True)
        rows = plan.out_tokens
        out: torch.Tensor = self.model(plan.tokens, plan.positions, attend, rows)
        return out

    def _capture(self, bucket: _Bucket) -> bool:
        """Capture `bucket`'s graph (on CUDA); False, and graphs off, if capture fails."""
        if not self.capture:
            return True
        size = len(bucket.plan.num_q_np)
        # Warm up (compiles the Triton kernel, settles the allocator) on the padding rows alone, so
        # the eager runs write nothing but the spare slot; then restore this pass's inputs.
        saved = bucket.meta.clone()
        bucket.meta.copy_(bucket.padding)
        try:
            _on_side_stream(lambda: self._forward(bucket))
            bucket.meta.copy_(saved)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                bucket.logits = self._forward(bucket)
        except Exception as exc:  # any failure to capture leaves the plain path serving
            self.disabled = f"capture of batch size {size} failed: {type(exc).__name__}: {exc}"
            log.warning("CUDA graphs off: %s", self.disabled)
            bucket.logits = None
            return False
        bucket.graph = graph
        log.info("captured the decode graph for batch size %d", size)
        return True


def _on_side_stream(fn: Callable[[], object], times: int = 2) -> None:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
