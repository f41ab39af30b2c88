"""Each example inferlet, run end to end on the dummy driver through the real engine."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Sequence

from wasmtime.component import Component

from host.engine import Engine, EngineConfig
from host.errors import HostError
from host.sandbox import BufferedRunIO, RunOutcome, RunStatus, Sandbox
from host.services import ModelInfo, NextStep, PassRequest, PassResult, Tokenizer, forward_by_one, generate_by_steps


def _run(
    sandbox: Sandbox, component: Component, engine: Engine, args: Sequence[str]
) -> tuple[RunOutcome, BufferedRunIO]:
    io = BufferedRunIO()
    outcome = sandbox.run(component, engine, args, io=io)
    assert outcome.status is RunStatus.OK, outcome.error
    return outcome, io


def test_hello(sandbox: Sandbox, components: dict[str, Component], engine: Engine) -> None:
    outcome, _ = _run(sandbox, components["hello"], engine, ["Ada"])
    assert outcome.output.startswith(f"Hello, Ada! This is {engine.model.name}.\n")


def test_text_completion_is_deterministic_when_greedy(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    args = ["--prompt", "The capital of France is", "--max-tokens", "12"]
    first, _ = _run(sandbox, components["text_completion"], engine, args)
    second, _ = _run(sandbox, components["text_completion"], engine, args)
    assert first.output == second.output  # the dummy's greedy token depends only on the context


def test_text_completion_reports_bad_arguments(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    outcome = sandbox.run(components["text_completion"], engine, ["--max-tokens", "3"])
    assert outcome.status is RunStatus.GUEST_ERROR
    assert "--prompt" in (outcome.error or "")
    assert "Traceback" not in (outcome.error or "")


def test_64_concurrent_text_completions_match_their_solo_runs(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    component = components["text_completion"]
    prompts = [f"Prompt number {i}: once upon a time" for i in range(64)]
    args = [["--prompt", p, "--max-tokens", "16"] for p in prompts]
    solo = [_run(sandbox, component, engine, a)[0].output for a in args]
    free_before = engine.num_free_pages
    handles = [sandbox.start(component, engine, a) for a in args]
    together = [h.wait(timeout_s=600) for h in handles]
    assert [o.status for o in together] == [RunStatus.OK] * 64, [o.error for o in together if not o.is_ok]
    assert [o.output for o in together] == solo
    assert engine.num_free_pages == free_before  # every run's pages came back


class ForkWatcher:
    """Delegates to the engine; on each fork, records the pages of parent and child and their
    reference counts right after the fork, as the engine's page table reports them."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self.forks: list[tuple[tuple[int, ...], tuple[int, ...], list[int], int]] = []

    @property
    def model(self) -> ModelInfo:
        return self._engine.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    def fork_context(self, run_id: int, context_id: int) -> int:
        child = self._engine.fork_context(run_id, context_id)
        parent_pages = self._engine.context_pages(context_id)
        child_pages = self._engine.context_pages(child)
        length = self._engine.context_length(run_id, context_id)
        with self._lock:
            refcounts = [self._engine.page_refcount(p) for p in parent_pages]
            self.forks.append((parent_pages, child_pages, refcounts, length))
        return child

    def create_context(self, run_id: int) -> int:
        return self._engine.create_context(run_id)

    def context_length(self, run_id: int, context_id: int) -> int:
        return self._engine.context_length(run_id, context_id)

    def truncate_context(self, run_id: int, context_id: int, length: int) -> None:
        self._engine.truncate_context(run_id, context_id, length)

    def release_context(self, run_id: int, context_id: int) -> None:
        self._engine.release_context(run_id, context_id)

    def forward(
        self, run_id: int, context_id: int, request: PassRequest, may_wait: Callable[[], None] | None = None
    ) -> PassResult:
        return self._engine.forward(run_id, context_id, request, may_wait)

    def forward_group(
        self, run_id: int, passes: Sequence[tuple[int, PassRequest]], may_wait: Callable[[], None] | None = None
    ) -> list[PassResult | HostError]:
        return forward_by_one(self, run_id, passes, may_wait)

    def generate(self, run_id: int, context_id: int, first: PassRequest, next_step: NextStep) -> None:
        generate_by_steps(self, run_id, context_id, first, next_step)

    def max_decode_steps(self) -> int:
        return self._engine.max_decode_steps()

    def load_adapter(self, run_id: int, name: str) -> int:
        return self._engine.load_adapter(run_id, name)

    def run_usage(self, run_id: int) -> tuple[int, int]:
        return self._engine.run_usage(run_id)

    def end_run(self, run_id: int) -> None:
        self._engine.end_run(run_id)


def test_parallel_generation_shares_the_prompt_pages(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    page_size = engine.model.page_size
    prompt = "x" * (2 * page_size + page_size // 2)  # bytes tokenizer: two full pages and a partial one
    assert len(engine.tokenizer.encode(prompt)) == len(prompt)
    watcher = ForkWatcher(engine)
    copies_before = int(engine.driver_health()["copies"])
    io = BufferedRunIO()
    outcome = sandbox.run(
        components["parallel_generation"],
        watcher,
        ["--prompt", prompt, "--branches", "4", "--max-tokens", "6", "--seed", "7"],
        io=io,
    )
    assert outcome.status is RunStatus.OK, outcome.error
    assert len(watcher.forks) == 4
    for parent_pages, child_pages, refcounts, length in watcher.forks:
        num_full = length // page_size
        assert num_full == 2
        assert child_pages[:num_full] == parent_pages[:num_full]  # shared, not copied
        assert all(r >= 2 for r in refcounts[:num_full])
        assert child_pages[num_full] != parent_pages[num_full]  # the partial page is copied
    assert int(engine.driver_health()["copies"]) > copies_before
    branches = json.loads(io.sent[-1])["branches"]
    assert len(branches) == 4
    assert outcome.output.count("\n") == 4


def test_beam_search(sandbox: Sandbox, components: dict[str, Component], engine: Engine) -> None:
    outcome, io = _run(
        sandbox,
        components["beam_search"],
        engine,
        ["--prompt", "The meaning of life is", "--beam-width", "3", "--max-tokens", "6"],
    )
    result = json.loads(io.sent[-1])
    assert 1 <= len(result["tokens"]) <= 6
    assert result["logprob"] < 0
    assert outcome.output == result["text"]


def test_leaked_contexts_and_cancelled_runs_give_their_pages_back(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    free_before = engine.num_free_pages
    outcome = sandbox.run(components["misbehave"], engine, ["leak", "5", "then-fail"])
    assert outcome.status is RunStatus.GUEST_ERROR
    assert outcome.num_leaked_resources == 5
    assert engine.num_free_pages == free_before

    io = BufferedRunIO()
    handle = sandbox.start(components["misbehave"], engine, ["decode_forever"], io=io)
    while engine.num_free_pages == free_before and not handle.is_done:  # until it holds pages
        threading.Event().wait(0.01)
    assert not handle.is_done, handle.wait().error
    handle.cancel()
    assert handle.wait(timeout_s=120).status is RunStatus.CANCELLED
    assert engine.num_free_pages == free_before


def test_passes_run_through_a_loaded_adapter(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    loads_before = int(engine.driver_health()["adapter_loads"])
    outcome = sandbox.run(components["misbehave"], engine, ["adapter", "demo-lora"])
    assert outcome.status is RunStatus.OK, outcome.error
    name, tokens = outcome.output.split(":")
    assert name == "demo-lora"
    assert len(tokens.split(",")) == 4
    assert int(engine.driver_health()["adapter_loads"]) == loads_before + 1


def test_text_the_host_generates_counts_against_the_output_limit(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    # `complete(emit_text=True)` streams from the engine's thread, not through `emit`: the same
    # limit holds, and the run ends at its next host call.
    config = dataclasses.replace(sandbox.config, max_output_bytes=2048)
    io = BufferedRunIO()
    outcome = sandbox.start(components["misbehave"], engine, ["complete_flood"], io=io, config=config).wait(120)
    assert outcome.status is RunStatus.LIMIT_EXCEEDED, outcome.error
    assert outcome.error is not None and "output limit exceeded" in outcome.error
    assert 0 < len(io.output.encode()) <= 2048


def test_an_adapter_path_from_the_guest_is_refused_before_the_driver(
    sandbox: Sandbox, components: dict[str, Component], engine: Engine
) -> None:
    loads_before = int(engine.driver_health()["adapter_loads"])
    for name in ("/etc/passwd", "../../../etc/passwd"):
        outcome = sandbox.run(components["misbehave"], engine, ["adapter", name])
        assert outcome.status is RunStatus.OK, outcome.error  # an error the guest handles
        assert outcome.output.startswith("refused: ") and "not a name inside the adapter directory" in outcome.output
    assert int(engine.driver_health()["adapter_loads"]) == loads_before


def test_truncate_rewinds_a_context(sandbox: Sandbox, components: dict[str, Component], engine: Engine) -> None:
    # The dummy's greedy token depends only on (input token, position): a rewound context that
    # is decoded again must repeat itself exactly.
    outcome = sandbox.run(components["misbehave"], engine, ["rewind"])
    assert outcome.status is RunStatus.OK, outcome.error
    result = json.loads(outcome.output)
    assert result["again"] == result["first"]
    assert result["tail"] == result["first"][2:4]
    assert result["len"] == 14


def test_a_run_cancelled_while_its_pass_waits_ends_cancelled(
    sandbox: Sandbox, components: dict[str, Component]
) -> None:
    """Cancel fails the pass the run is waiting for at a slow driver: the run ends CANCELLED at
    once, not as a failed pass, and not after the driver's 300 ms."""
    with Engine.start(EngineConfig(driver="dummy", driver_args=["--pass-latency-ms", "300"])) as slow:
        io = BufferedRunIO()
        args = ["--prompt", "Once", "--max-tokens", "50"]
        handle = sandbox.start(components["text_completion"], slow, args, io=io)
        while not io.output and not handle.is_done:
            threading.Event().wait(0.01)  # until it has generated: its next pass waits 300 ms
        assert not handle.is_done, handle.wait().error
        handle.cancel()
        outcome = handle.wait(timeout_s=120)
        assert outcome.status is RunStatus.CANCELLED, (outcome.status, outcome.error)
