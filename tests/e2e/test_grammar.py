"""Grammar-constrained decoding end to end on the dummy driver, speculation on: the output
follows the grammar (invariant: a grammar-constrained step is never served by a staged fire,
which carries no mask)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wasmtime.component import Component

from host.build import build
from host.engine import Engine
from host.sandbox import Sandbox

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
}


@pytest.fixture(scope="module")
def json_decoding(sandbox: Sandbox, cache_dir: Path) -> Component:
    return sandbox.load(build("json_decoding", cache_dir).wasm_path)


def test_schema_output_parses_and_validates(sandbox: Sandbox, json_decoding: Component, engine: Engine) -> None:
    for seed in range(4):
        args = ["--prompt", "x", "--schema", json.dumps(SCHEMA), "--temperature", "1", "--seed", str(seed)]
        outcome = sandbox.run(json_decoding, engine, args)
        assert outcome.is_ok, outcome.error
        value = json.loads(outcome.output)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9


def test_any_json_object_starts_with_a_brace(sandbox: Sandbox, json_decoding: Component, engine: Engine) -> None:
    before = engine.speculation_stats()
    for seed in range(4):
        args = ["--prompt", "x", "--temperature", "1", "--seed", str(seed), "--max-tokens", "64"]
        outcome = sandbox.run(json_decoding, engine, args)
        assert outcome.is_ok, outcome.error
        assert outcome.output.startswith("{"), outcome.output
    assert engine.speculation_stats().get("speculation_hits", 0) == before.get("speculation_hits", 0)


def test_a_bad_schema_is_a_clear_error(sandbox: Sandbox, json_decoding: Component, engine: Engine) -> None:
    outcome = sandbox.run(json_decoding, engine, ["--prompt", "x", "--schema", '{"type": "objekt"}'])
    assert not outcome.is_ok and "objekt" in (outcome.error or "")
