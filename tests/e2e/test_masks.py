"""Masks end to end: a windowed inferlet's passes carry only its window's pages, and a
logit-masked inferlet's output obeys its mask even with speculation on (a staged fire carries
no mask, so it must never serve a masked step)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox import Sandbox

PAGE = 4


@pytest.fixture(scope="module")
def recording_engine() -> Iterator[Engine]:
    args = ["--page-size", str(PAGE), "--num-pages", "4096"]
    with Engine.start(
        EngineConfig("loopback", args, driver_module="tests.e2e.recording_driver", speculation_depth=1)
    ) as e:
        yield e


def test_windowed_attention_decodes_see_only_the_window(
    sandbox: Sandbox, cache_dir: Path, recording_engine: Engine
) -> None:
    component = sandbox.load(build("windowed_attention", cache_dir).wasm_path)
    prompt = "x" * 200  # 200 byte tokens: 50 pages
    args = ["--prompt", prompt, "--window", "8", "--sinks", "4", "--max-tokens", "60", "--ignore-eos"]
    outcome = sandbox.run(component, recording_engine, args)
    assert outcome.is_ok, outcome.error
    stats = recording_engine.driver_health()
    assert stats["masked_max_position"] >= 255  # the context grew past 250 tokens ...
    # ... yet no decode step carried more than the sinks' page, the window's pages and the page
    # it writes (the prefill writes, and so carries, every page of the prompt).
    assert 0 < stats["masked_decode_max_pages"] <= 1 + 8 // PAGE + 2
    assert stats["masked_requests"] >= 60


def test_logit_masked_steps_are_never_served_by_a_staged_fire(
    sandbox: Sandbox, cache_dir: Path, engine: Engine
) -> None:
    component = sandbox.load(build("digits", cache_dir).wasm_path)
    for seed in range(3):
        outcome = sandbox.run(component, engine, ["--max-tokens", "48", "--seed", str(seed)])
        assert outcome.is_ok, outcome.error
        assert len(outcome.output) == 48 and outcome.output.isdigit(), outcome.output
