"""tool_call end to end on the dummy driver, speculation on (depth 1): every finished call (the
grammar terminated: the inferlet's last `send` says "stop") is `{"name": ..., "arguments": ...}`
naming an allowed tool, its arguments valid against that tool's parameter schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from wasmtime.component import Component

from host.build import build
from host.engine import Engine
from host.sandbox import Sandbox
from host.sandbox.run_io import BufferedRunIO

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "metric": {"type": "boolean"},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                    "label": {"type": "string", "maxLength": 6},
                    "days": {"type": "array", "items": {"enum": ["mon", "tue", "sat"]}, "maxItems": 2},
                },
                "required": ["hour", "label", "days"],
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tool_call(sandbox: Sandbox, cache_dir: Path) -> Component:
    return sandbox.load(build("tool_call", cache_dir).wasm_path)


@pytest.mark.parametrize("choice", ["get_weather", "set_alarm", "required"])
def test_finished_calls_name_an_allowed_tool_with_valid_arguments(
    sandbox: Sandbox, tool_call: Component, engine: Engine, choice: str
) -> None:
    before = engine.speculation_stats()
    finished: set[str] = set()
    for seed in range(8):
        io = BufferedRunIO()
        args = ["--tools", json.dumps(TOOLS), "--choice", choice, "--temperature", "1", "--seed", str(seed)]
        outcome = sandbox.run(tool_call, engine, [*args, "--max-tokens", "96"], io=io)
        assert outcome.is_ok, outcome.error
        assert outcome.output.startswith('{"name":'), outcome.output
        if json.loads(io.sent[-1])["finish_reason"] != "stop":
            continue
        call = json.loads(outcome.output)
        assert set(call) == {"name", "arguments"}, call
        assert call["name"] == choice or (choice == "required" and call["name"] in PARAMETERS), call
        jsonschema.Draft202012Validator(PARAMETERS[call["name"]]).validate(call["arguments"])
        finished.add(call["name"])
    assert finished  # deterministic: the seeds fix every draw
    assert engine.speculation_stats().get("speculation_hits", 0) == before.get("speculation_hits", 0)


def test_an_unknown_tool_choice_is_a_clear_error(sandbox: Sandbox, tool_call: Component, engine: Engine) -> None:
    outcome = sandbox.run(tool_call, engine, ["--tools", json.dumps(TOOLS), "--choice", "get_time"])
    assert not outcome.is_ok and "get_time" in (outcome.error or ""), outcome.error


def test_auto_is_refused_since_a_call_is_always_made(sandbox: Sandbox, tool_call: Component, engine: Engine) -> None:
    outcome = sandbox.run(tool_call, engine, ["--tools", json.dumps(TOOLS), "--choice", "auto"])
    assert not outcome.is_ok and "--choice" in (outcome.error or ""), outcome.error
