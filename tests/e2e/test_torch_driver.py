"""The inferlets end to end on the torch driver with SmolLM2 (a real model on this CPU), and
what only a real model can show: speculation and prefix reuse change no output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bridge_schema.batch import OutputSpec, Sampler
from bridge_schema.messages import Probe
from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox import Sandbox
from host.services import PassRequest

TORCH_ARGS = ["--threads", "1", "--num-pages", "512", "--dtype", "float32"]
PAGE = 16


@pytest.fixture(scope="module")
def torch_engine() -> Iterator[Engine]:
    with Engine.start(
        EngineConfig(
            "torch", TORCH_ARGS, page_size=PAGE, prefix_match_unit=PAGE, speculation_depth=1, startup_timeout_s=300
        )
    ) as e:
        yield e


def run(sandbox: Sandbox, cache_dir: Path, engine: Engine, name: str, args: list[str]) -> str:
    component = sandbox.load(build(name, cache_dir).wasm_path)
    outcome = sandbox.run(component, engine, args)
    assert outcome.is_ok, outcome.error
    return outcome.output


def test_text_completion_answers(sandbox: Sandbox, cache_dir: Path, torch_engine: Engine) -> None:
    args = ["--prompt", "What is the capital of France?", "--chat", "--max-tokens", "16"]
    assert "Paris" in run(sandbox, cache_dir, torch_engine, "text_completion", args)


def test_digits_obey_the_logit_mask(sandbox: Sandbox, cache_dir: Path, torch_engine: Engine) -> None:
    out = run(sandbox, cache_dir, torch_engine, "digits", ["--max-tokens", "6", "--temperature", "0"])
    assert len(out) == 6 and out.isdigit()


def test_windowed_attention_and_parallel_generation_run(
    sandbox: Sandbox, cache_dir: Path, torch_engine: Engine
) -> None:
    args = ["--prompt", "The history of Rome", "--window", "16", "--sinks", "4", "--max-tokens", "24"]
    assert run(sandbox, cache_dir, torch_engine, "windowed_attention", args).strip()
    args = ["--prompt", "Once upon a time", "--branches", "3", "--max-tokens", "8"]
    assert run(sandbox, cache_dir, torch_engine, "parallel_generation", args).strip()


def test_speculation_changes_no_greedy_output(sandbox: Sandbox, cache_dir: Path, torch_engine: Engine) -> None:
    args = ["--prompt", "Write a haiku about the sea.", "--chat", "--max-tokens", "40"]
    before = torch_engine.speculation_stats()["speculation_hits"]
    speculative = run(sandbox, cache_dir, torch_engine, "text_completion", args)
    assert torch_engine.speculation_stats()["speculation_hits"] - before >= 20  # it really speculated
    with Engine.start(
        EngineConfig("torch", TORCH_ARGS, page_size=PAGE, speculation_depth=0, startup_timeout_s=300)
    ) as cold:
        assert run(sandbox, cache_dir, cold, "text_completion", args) == speculative


def test_a_warm_prefix_gives_the_cold_logits(torch_engine: Engine) -> None:
    prompt = torch_engine.tokenizer.encode("You are a helpful assistant. " * 6 + "Tell me about owls.")
    assert len(prompt) > 2 * PAGE

    def last_row_logprobs() -> np.ndarray:
        ctx = torch_engine.create_context(7)
        out = torch_engine.forward(
            7, ctx, PassRequest(tokens=prompt, outputs=[OutputSpec(len(prompt) - 1, Sampler(), Probe.DISTRIBUTION)])
        )
        dist = out.outputs[0].distribution
        assert dist is not None
        return np.array(dist)

    before = torch_engine.prefix_stats()["prefix_tokens_reused"]
    cold = last_row_logprobs()
    warm = last_row_logprobs()
    reused = torch_engine.prefix_stats()["prefix_tokens_reused"] - before
    assert reused == (len(prompt) - 1) // PAGE * PAGE
    np.testing.assert_allclose(warm, cold, atol=1e-3)
    torch_engine.end_run(7)
