"""Speculative decoding as an inferlet (spec_ngram) on the torch driver with SmolLM2, greedy:
the output equals plain greedy decoding whether every draft is accepted, none is, or part is,
each after a long decode; with a JSON grammar too, where the row that predicts draft token j is
masked by the grammar state after tokens 0..j-1 (shifting the masks by one changes the output)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from wasmtime.component import Component

from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox import Sandbox
from host.sandbox.run_io import BufferedRunIO

COPY_PROMPT = (
    "Repeat the following text exactly, word for word: The committee met on Tuesday to review the "
    "budget. The committee agreed to fund the library, the park and the new school. The committee "
    "will meet again on Friday to review the budget for the library, the park and the new school."
)
JSON_PROMPT = "Describe a cat as a JSON object with its name, age and favourite food."


@pytest.fixture(scope="module")
def torch_engine() -> Iterator[Engine]:
    args = ["--threads", "1", "--dtype", "float32"]
    with Engine.start(EngineConfig("torch", args, speculation_depth=1, startup_timeout_s=300)) as e:
        yield e


@pytest.fixture(scope="module")
def spec(sandbox: Sandbox, cache_dir: Path) -> Component:
    return sandbox.load(build("spec_ngram", cache_dir).wasm_path)


def run(sandbox: Sandbox, component: Component, engine: Engine, args: list[str]) -> tuple[str, dict[str, Any]]:
    io = BufferedRunIO()
    outcome = sandbox.run(component, engine, args, io=io)
    assert outcome.is_ok, outcome.error
    return outcome.output, json.loads(io.sent[-1])


def test_output_equals_plain_greedy_with_all_some_or_no_drafts_accepted(
    sandbox: Sandbox, spec: Component, torch_engine: Engine
) -> None:
    base = ["--prompt", COPY_PROMPT, "--chat", "--max-tokens", "64"]
    plain, plain_stats = run(sandbox, spec, torch_engine, [*base, "--draft", "0"])
    oracle_ids = ",".join(map(str, plain_stats["tokens"]))
    assert plain_stats["drafted"] == 0 and plain_stats["generated"] >= 40
    looked_up, stats = run(sandbox, spec, torch_engine, base)
    assert looked_up == plain
    assert 0 < stats["accepted"] < stats["drafted"]  # part accepted
    assert stats["passes"] < plain_stats["passes"]  # and fewer passes than tokens
    oracle, stats = run(sandbox, spec, torch_engine, [*base, "--drafts", "oracle", "--oracle", oracle_ids])
    assert oracle == plain and stats["accepted"] == stats["drafted"] > 0  # every draft accepted
    bad, stats = run(sandbox, spec, torch_engine, [*base, "--drafts", "bad"])
    assert bad == plain and stats["drafted"] > 0 and stats["accepted"] == 0  # every draft rejected


def test_with_a_json_grammar_each_mask_gates_the_token_its_row_predicts(
    sandbox: Sandbox, spec: Component, torch_engine: Engine
) -> None:
    base = ["--prompt", JSON_PROMPT, "--chat", "--json", "--max-tokens", "96"]
    plain, plain_stats = run(sandbox, spec, torch_engine, [*base, "--draft", "0"])
    assert isinstance(json.loads(plain), dict)
    oracle_ids = ",".join(map(str, plain_stats["tokens"]))
    oracle, stats = run(sandbox, spec, torch_engine, [*base, "--drafts", "oracle", "--oracle", oracle_ids])
    assert stats["drafted"] > 10 and stats["accepted"] == stats["drafted"]
    assert oracle == plain
    looked_up, _ = run(sandbox, spec, torch_engine, base)
    assert looked_up == plain
