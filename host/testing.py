"""Testing inferlets: run one on the dummy driver in this process, talk to it, and look at what it
did. The same API serves plain Python and pytest (the `inferlet_runner` fixture of the plugin
`host.pytest_plugin`, registered when wafer is installed).

    with InferletRunner(say="Hello!") as runner:      # the "model" says Hello! then ends its text
        result = runner.run("inferlets/text_completion", "--prompt", "Hi", "--max-tokens", "16")
        assert result.ok and result.output == "Hello!"
        live = runner.start("my_chat")                 # messages both ways
        live.send("first question")
        live.close()                                   # receive() returns None from here on
        result = live.wait()
        assert result.messages == ['{"answered": 1}'] and result.pages_held == 0

A runner builds an inferlet when it starts it (cached by content, as `wafer build`), keeps one sandbox and
one dummy driver (in-process, frames still encoded), and reports for each run its output, the
messages it sent, its error, and what it still held when its main returned: contexts not
released and the KV pages they held (forks' shared pages counted once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from host.build import build, resolve_inferlet, rewrite_guest_paths
from host.engine import Engine, EngineConfig
from host.sandbox import BufferedRunIO, RunHandle, RunStatus, Sandbox, SandboxConfig
from host.sandbox.config import MIB, RunHostLimits, default_cache_dir

_Counters = Callable[[], tuple[int, int]]


@dataclass(frozen=True, slots=True)
class RunResult:
    status: str  # a RunStatus value: "ok", "guest_error", "trapped", "timed_out", "cancelled", ...
    output: str  # everything the run emitted
    messages: list[str]  # what it sent, in order
    error: str | None  # why it did not end "ok"
    contexts_held: int  # contexts it had not released when its main returned
    pages_held: int  # the KV pages those contexts held (pages shared by forks once)
    run_id: int
    # The engine's counters over the run, from its start to its end (so they include any
    # other run of the runner live meanwhile): device passes the driver ran (a batch of
    # several contexts' passes is one), and decode steps answered by a speculatively
    # pre-fired pass (0 with `speculation_depth=0`).
    forwards: int = 0
    speculation_hits: int = 0
    # The run's own pass requests (fills, decode steps, each pass of a group; a multi-step
    # request of host-side generation is one, however many steps the engine ran in it).
    passes: int = 0

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.OK.value


class LiveRun:
    """A started run: send it messages, close its inbox, wait for its result."""

    def __init__(
        self,
        handle: RunHandle,
        io: BufferedRunIO,
        source_dir: Path | None,
        counters: _Counters,
        at_start: tuple[int, int],
    ) -> None:
        self._handle = handle
        self._io = io
        self._source_dir = source_dir
        self._counters = counters
        self._at_start = at_start

    def send(self, message: str) -> None:
        """A message the run's `receive()` returns."""
        self._io.push(message)

    def close(self) -> None:
        """The client sends nothing more: `receive()` returns None from here on."""
        self._io.close()

    def cancel(self) -> None:
        self._handle.cancel()

    @property
    def output(self) -> str:
        """What the run emitted so far."""
        return self._io.output

    @property
    def messages(self) -> list[str]:
        """What the run sent so far."""
        return list(self._io.sent)

    def wait(self) -> RunResult:
        outcome = self._handle.wait()
        forwards, hits = (end - start for end, start in zip(self._counters(), self._at_start, strict=True))
        error = outcome.error
        if error is not None and self._source_dir is not None:
            error = rewrite_guest_paths(error, self._source_dir)  # tracebacks name your files
        return RunResult(
            outcome.status.value,
            outcome.output,
            list(self._io.sent),
            error,
            outcome.held_contexts,
            outcome.held_pages,
            outcome.run_id,
            forwards,
            hits,
            int(self._handle.stats()["num_passes"]),
        )


@dataclass
class InferletRunner:
    """`say`: the text the dummy "model" says in every context (its UTF-8 bytes, one sampled
    token each, then the end-of-text token; a grammar's or mask's refusal of the next byte falls
    back to a draw within it), or None for random tokens. The other knobs are the dummy driver's
    (vocab_size at least 260: 256 bytes and 4 special tokens; max_context, the positions a
    context may use; pass_latency_ms, a simulated device time per pass) and the run's limits
    (`host_limits`: what a run may hold on the host, as the daemon's `run_max_*` keys set it).
    `logits`: the "model's" logits at every row, {token or one-character text: logit} (others
    0), so that a sampler chain's effect can be tested: rows sample from them, after the chain,
    as the torch driver would."""

    say: str | None = None
    logits: dict[int | str, float] | None = None
    vocab_size: int = 260
    page_size: int = 16
    num_pages: int = 4096
    max_context: int = 32768
    pass_latency_ms: float = 0.0
    seed: int = 0
    speculation_depth: int = 1
    memory_mib: int = 256
    timeout_s: float = 60.0
    host_limits: RunHostLimits = field(default_factory=RunHostLimits)
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        args = ["--vocab-size", str(self.vocab_size), "--page-size", str(self.page_size)]
        args += ["--num-pages", str(self.num_pages), "--seed", str(self.seed), "--max-context", str(self.max_context)]
        args += ["--pass-latency-ms", str(self.pass_latency_ms)]
        if self.say is not None:
            args += ["--say", self.say]
        if self.logits:
            args += ["--logits", ",".join(f"{token}={float(value)!r}" for token, value in self.logits.items())]
        self._config = SandboxConfig(
            cache_dir=self.cache_dir,
            memory_limit_bytes=self.memory_mib * MIB,
            wall_budget_s=self.timeout_s,
            host_limits=self.host_limits,
        )
        self._sandbox = Sandbox(self._config).__enter__()
        try:
            self._engine = Engine.start(EngineConfig("loopback", tuple(args), speculation_depth=self.speculation_depth))
        except BaseException:
            self._sandbox.__exit__(None, None, None)
            raise

    @property
    def engine(self) -> Engine:
        """The engine the runs use (pages free, speculation statistics, ...)."""
        return self._engine

    def build(self, inferlet: str | Path) -> Path:
        """The built component of an inferlet folder (or a name under inferlets/, or a .wasm):
        built again if its sources changed (a fraction of a second on wafer's base)."""
        path = Path(inferlet)
        return path if path.suffix == ".wasm" else build(str(inferlet), self.cache_dir).wasm_path

    def start(self, inferlet: str | Path, *args: str) -> LiveRun:
        loaded = self._sandbox.load(self.build(inferlet))
        io = BufferedRunIO()
        at_start = self._counters()
        handle = self._sandbox.start(loaded, self._engine, list(args), io=io)
        source_dir = None if Path(inferlet).suffix == ".wasm" else resolve_inferlet(str(inferlet))
        return LiveRun(handle, io, source_dir, self._counters, at_start)

    def _counters(self) -> tuple[int, int]:
        forwards = int(self._engine.driver_health()["forwards"])
        return forwards, self._engine.speculation_stats().get("speculation_hits", 0)

    def run(self, inferlet: str | Path, *args: str, messages: Sequence[str] = ()) -> RunResult:
        """Run to the end: `messages` are waiting for its `receive()`, then the inbox closes."""
        live = self.start(inferlet, *args)
        for message in messages:
            live.send(message)
        live.close()
        return live.wait()

    def close(self) -> None:
        try:
            self._engine.close()
        finally:
            self._sandbox.__exit__(None, None, None)

    def __enter__(self) -> InferletRunner:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
