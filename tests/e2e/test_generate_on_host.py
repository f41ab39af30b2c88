"""`forward-pass.generate` (the SDK's `Context.complete`): the host's generation loop gives what
the guest's per-token loop gives, token for token, and leaves the context in the same state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from wasmtime.component import Component

from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox import Sandbox, SandboxConfig
from host.sandbox.outcome import RunStatus
from host.sandbox.run_io import BufferedRunIO

PARITY = Path(__file__).parent / "inferlets" / "generate_parity"
CASES = ("greedy", "default_stop", "stop_list", "random", "grammar", "window", "one", "zero")


@pytest.fixture(scope="module")
def parity(sandbox: Sandbox, cache_dir: Path) -> Component:
    return sandbox.load(build(str(PARITY), cache_dir).wasm_path)


def _message(sandbox: Sandbox, component: Component, engine: Engine, args: list[str]) -> Any:
    io = BufferedRunIO()
    outcome = sandbox.run(component, engine, args, io=io)
    assert outcome.status is RunStatus.OK, outcome.error
    (message,) = io.sent
    return json.loads(message)


@pytest.mark.parametrize("case", CASES)
def test_host_loop_equals_guest_loop(sandbox: Sandbox, parity: Component, engine: Engine, case: str) -> None:
    result = _message(sandbox, parity, engine, [case])
    guest, host = result["guest"], result["host"]
    assert host == guest
    if case == "zero":
        assert host["tokens"] == []
        return
    assert host["tokens"], "nothing generated"
    # The last token sampled is pending; everything before it is in the KV.
    assert host["committed"] == host["kv_length"] == len(host["all"]) - 1
    if case in ("default_stop", "stop_list", "grammar"):
        assert len(host["all"]) > len(host["tokens"]) + 1  # ended by a token it did not return
    if case == "grammar":
        text = bytes(host["tokens"]).decode()  # the dummy's bytes tokenizer
        assert text.rstrip("!") in ("yes", "no", "maybe") and text.endswith("!"), text


def test_host_loop_refuses_passes_it_cannot_repeat(sandbox: Sandbox, parity: Component, engine: Engine) -> None:
    errors = _message(sandbox, parity, engine, ["refusals"])
    assert errors == [
        "generate needs exactly one output, on the pass's last input row",
        "generate reports no probes: execute passes one by one to read logprobs",
        "generate continues the context: explicit positions are not allowed",
    ]


def test_host_loop_streams_the_text_the_guest_loop_emits(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    args = ["--prompt", "Stream me", "--max-tokens", "40", "--ignore-eos"]
    outputs = []
    for mode in ([], ["--per-token"]):
        chunks: list[str] = []
        outcome = sandbox.run(components["text_completion"], engine, args + mode, io=BufferedRunIO(chunks.append))
        assert outcome.status is RunStatus.OK, outcome.error
        outputs.append(("".join(chunks), len(chunks)))
    (host_text, host_chunks), (guest_text, guest_chunks) = outputs
    assert host_text == guest_text and host_text
    assert host_chunks == guest_chunks > 1  # streamed piece by piece, not in one chunk at the end


def test_host_loop_out_of_pages_keeps_what_it_generated(sandbox: Sandbox, parity: Component) -> None:
    with Engine.start(EngineConfig(driver="dummy", driver_args=["--num-pages", "4"], speculation_depth=1)) as small:
        result = _message(sandbox, parity, small, ["exhaust"])
        assert "out of" in result["error"].lower(), result
        capacity = 4 * small.model.page_size
        # Every slot was used, and the guest's view of the context matches the host's.
        assert result["kv_length"] == result["committed"] == capacity
        assert result["all"] == capacity + 1  # the last sampled token is pending
        assert small.num_free_pages == 4  # the run's pages came back


def test_host_loop_stops_at_the_runs_wall_clock_budget(
    sandbox: Sandbox, components: dict[str, Component], cache_dir: Path
) -> None:
    """The host loop checks the run's budget between passes: a long generation on a slow driver
    ends TIMED_OUT after the budget (plus at most a pass), with what it streamed so far kept."""
    config = SandboxConfig(cache_dir=cache_dir, wall_budget_s=1.0, inactivity_timeout_s=30.0)
    with Engine.start(EngineConfig(driver="dummy", driver_args=["--pass-latency-ms", "20"])) as slow:
        chunks: list[str] = []
        args = ["--prompt", "Once", "--max-tokens", "100000", "--ignore-eos"]
        io = BufferedRunIO(chunks.append)
        handle = sandbox.start(components["text_completion"], slow, args, io=io, config=config)
        try:
            outcome = handle.wait(timeout_s=60)
        except TimeoutError:
            handle.cancel()
            raise AssertionError("the budget did not stop the host loop") from None
    assert outcome.status is RunStatus.TIMED_OUT, (outcome.status, outcome.error)
    assert "wall-clock budget" in (outcome.error or "")
    assert chunks, "nothing was streamed before the budget ran out"
