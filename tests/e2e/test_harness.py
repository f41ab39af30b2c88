"""The inferlet test harness (host.testing, and the `inferlet_runner` fixture of wafer's pytest
plugin): the examples run through it on the dummy driver, with a scripted "model", messages both
ways, and what a run still held when it ended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from host.testing import InferletRunner

HERE = Path(__file__).parent
ECHO = HERE.parents[0] / "host" / "daemon" / "inferlets" / "echo"
LEAKY = HERE / "inferlets" / "leaky"


@pytest.mark.dummy(say="Hello, world!")
def test_streaming_text_completion_says_the_script(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run("text_completion", "--prompt", "Hi", "--max-tokens", "40")
    assert result.ok and result.output == "Hello, world!"  # then end-of-text ended it
    assert result.contexts_held == 0 and result.pages_held == 0
    short = inferlet_runner.run("text_completion", "--prompt", "Hi", "--max-tokens", "5")
    assert short.output == "Hello"


@pytest.mark.dummy(say='{"name":"Ada","age":36}')
def test_grammar_constrained_json_follows_the_script_where_the_grammar_allows(
    inferlet_runner: InferletRunner,
) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    result = inferlet_runner.run("json_decoding", "--schema", json.dumps({**schema, "required": ["name", "age"]}))
    assert result.ok, result.error
    assert json.loads(result.output) == {"name": "Ada", "age": 36}
    assert result.messages == ['{"finish_reason": "stop"}']
    # A grammar that refuses the script: the draws stay inside its mask, and the JSON is valid.
    other = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    result = inferlet_runner.run("json_decoding", "--schema", json.dumps(other), "--max-tokens", "64")
    assert result.ok and result.output.startswith('{"n":')


@pytest.mark.dummy(say="ab")
def test_forked_branches_each_say_the_script_and_free_their_pages(inferlet_runner: InferletRunner) -> None:
    free = inferlet_runner.engine.num_free_pages
    result = inferlet_runner.run("parallel_generation", "--prompt", "x" * 40, "--branches", "3")
    assert result.ok, result.error
    assert result.output == "[0] ab\n[1] ab\n[2] ab\n"
    assert json.loads(result.messages[-1]) == {"branches": ["ab", "ab", "ab"]}
    assert result.pages_held == 0 and inferlet_runner.engine.num_free_pages == free


def test_messages_both_ways(inferlet_runner: InferletRunner) -> None:
    live = inferlet_runner.start(ECHO, "echo")
    live.send("one")
    live.send("two")
    live.close()
    result = live.wait()
    assert result.ok and result.output == "echo: one\necho: two\n"
    assert result.messages == ['{"received": 2}']
    assert inferlet_runner.run(ECHO, "echo", messages=["x"]).messages == ['{"received": 1}']


@pytest.mark.dummy(page_size=16)
def test_what_a_run_still_held_is_counted(inferlet_runner: InferletRunner) -> None:
    held = inferlet_runner.run(LEAKY, "3", "40")  # 41 tokens each: 3 pages of 16
    assert held.ok and (held.contexts_held, held.pages_held) == (3, 9)
    released = inferlet_runner.run(LEAKY, "3", "40", "release")
    assert (released.contexts_held, released.pages_held) == (0, 0)
    assert inferlet_runner.engine.num_free_pages == inferlet_runner.engine.num_pages  # freed after either


def test_a_failing_run_reports_its_error(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run("text_completion", "--max-tokens", "4")  # --prompt is required
    assert not result.ok and result.status == "guest_error"
    assert "the following arguments are required: --prompt" in (result.error or "")


def test_the_runner_works_without_pytest() -> None:
    with InferletRunner(say="ok", seed=3) as runner:
        assert runner.run("text_completion", "--prompt", "?", "--max-tokens", "8").output == "ok"
