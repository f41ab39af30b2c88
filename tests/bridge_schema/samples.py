"""One fixed, valid instance of every message type, used by golden-bytes and fuzz tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, build_forward, pack_allowed
from bridge_schema.limits import Limits
from bridge_schema.messages import (
    Ack,
    Adapter,
    Copy,
    ErrorReply,
    Forward,
    ForwardResult,
    Handshake,
    Health,
    HealthReply,
    Hello,
    Message,
    Probe,
    Shutdown,
)

LIMITS = Limits(
    vocab_size=260,
    page_size=4,
    num_pages=64,
    max_context=1024,
    max_requests_per_pass=16,
    max_tokens_per_pass=256,
    max_mask_bytes=1 << 20,
    max_probe_k=8,
)


def sample_forward() -> Message:
    return build_forward(
        7,
        [
            RequestSpec(
                context_id=3,
                tokens=[10, 11, 12, 13, 14],
                positions=[0, 1, 2, 3, 4],
                pages=[5, 6],
                last_page_len=1,
                outputs=[
                    OutputSpec(
                        4,
                        dataclasses.replace(
                            Sampler.random(0.7, top_k=40, top_p=0.9, min_p=0.05, seed=11),
                            repetition_penalty=1.25,
                            frequency_penalty=0.5,
                            penalty_from=2,
                            penalty_last_n=64,
                            logit_bias=((12, -100.0), (30, 2.5)),
                            typical_p=0.9,
                            xtc_probability=0.5,
                            mirostat_tau=5.0,
                            dry_multiplier=0.8,
                            dry_breakers=(10, 13),
                        ),
                    )
                ],
            ),
            RequestSpec(
                context_id=4,
                tokens=[20, 21],
                positions=[8, 9],
                pages=[1, 2, 3],
                last_page_len=2,
                adapter_id=2,
                mask_rows=[[0, 10], [2, 8]],
                outputs=[
                    OutputSpec(0, probe=Probe.LOGPROBS, probe_k=3, score_token=21),
                    OutputSpec(1, probe=Probe.DISTRIBUTION, logit_mask=pack_allowed(260, [1, 2, 3])),
                ],
            ),
            RequestSpec(context_id=5, tokens=[0], positions=[4], pages=[7], last_page_len=1, deferred=True),
        ],
    )


def sample_multi_step_forward(pages: tuple[int, ...] = (1, 2), last_page_len: int = 4) -> Forward:
    """A valid Forward with a multi-step request (3 steps, at KV slot 5 of 8) between two plain
    ones; `pages` and `last_page_len` are the multi-step request's."""
    return build_forward(
        8,
        [
            RequestSpec(context_id=1, tokens=[3, 4], positions=[0, 1], pages=[0], last_page_len=2),
            RequestSpec(
                context_id=2,
                tokens=[9],
                positions=[5],
                pages=list(pages),
                last_page_len=last_page_len,
                outputs=[OutputSpec(j, Sampler.random(0.8, seed=4)) for j in range(3)],
                steps=3,
            ),
            RequestSpec(context_id=3, tokens=[7], positions=[2], pages=[3], last_page_len=3, outputs=[OutputSpec(0)]),
        ],
    )


def samples() -> dict[str, Message]:
    return {
        "hello": Hello(id=1, page_size=16, num_pages=128, prefix_match_unit=16, speculation_depth=1),
        "handshake": Handshake(
            id=1,
            driver_kind="dummy",
            model_name="dummy",
            vocab_size=260,
            page_size=16,
            num_pages=128,
            max_context=4096,
            max_requests_per_pass=64,
            max_tokens_per_pass=1024,
            max_mask_bytes=4096,
            max_probe_k=20,
            max_fill_chunk_tokens=512,
            capabilities=["logit_mask", "copy"],
            tokenizer_kind="bytes",
            chat_template="{{ messages }}",
            stop_token_ids=np.array([258], np.uint32),
            control_token_ids=np.array([256, 257, 258, 259], np.uint32),
            driver_info={"device": "cpu", "cpu_kernels": "w8a8 avx2"},
        ),
        "forward": sample_forward(),
        "forward_result": ForwardResult(
            id=7,
            tokens=np.array([5, 6, 1], np.int32),
            logprobs=np.array([0.0, -1.5, 0.0], np.float32),
            topk_indptr=np.array([0, 0, 2, 2], np.uint32),
            topk_ids=np.array([6, 9], np.uint32),
            topk_logprobs=np.array([-1.5, -2.0], np.float32),
            dist_indptr=np.array([0, 0, 0, 4], np.uint32),
            dists=np.array([-np.inf, -1.0, -1.0, -1.0], np.float32),
        ),
        "copy": Copy(id=9, src_pages=np.array([1, 2], np.uint32), dst_pages=np.array([7, 8], np.uint32)),
        "adapter": Adapter(id=10, op="load", adapter_id=3, path="/adapters/a"),
        "health": Health(id=11),
        "shutdown": Shutdown(id=12),
        "ack": Ack(id=9),
        "health_reply": HealthReply(id=11, stats={"forwards": 3, "state": "ok", "load": 0.5}),
        "error": ErrorReply(id=13, status=2, code="range", field="forward.tokens", message="too big"),
    }
