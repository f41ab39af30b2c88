"""The seam between the inferlet API (host functions, one thread per run) and the engine that
owns pages, scheduling and the driver. Host modules call only this protocol; every method is
blocking and thread-safe, and raises `host.errors.HostError` subclasses on failure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from bridge_schema.batch import OutputResult, OutputSpec
from host.errors import HostError

if TYPE_CHECKING:
    from host.grammar import GrammarCompiler


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    vocab_size: int
    page_size: int
    max_context: int
    stop_token_ids: tuple[int, ...]
    control_token_ids: tuple[int, ...]
    # The most tokens one run's KV pages may hold (its share of the pool); 0: no such limit. A
    # context whose pages are all kept (a plain chat) is that long at most; one that releases
    # pages (a sliding window) may run to max_context.
    run_max_tokens: int = 0
    max_probe_k: int = 20  # the most top tokens one probe reports (the driver's limit)

    @property
    def kept_context(self) -> int:
        """The longest context that keeps every page: max_context, or less under the run's share."""
        return min(self.max_context, self.run_max_tokens) if self.run_max_tokens else self.max_context


@dataclass(slots=True)
class PassRequest:
    """One forward pass of one context as an inferlet asks for it.

    `positions` None means "continue the context": len(ctx), len(ctx)+1, ...
    `mask_rows` holds BRLE runs per input row over the keys the pass covers (None = causal).
    """

    tokens: Sequence[int] | npt.NDArray[np.uint32]
    positions: Sequence[int] | None = None
    outputs: Sequence[OutputSpec] = ()
    adapter_id: int = -1
    mask_rows: Sequence[Sequence[int]] | None = None
    # A compact mask for every row: attend to the first `attention_sinks` keys and the
    # `attention_window` keys ending at the row's own slot (0 = no window). The host expands it.
    attention_window: int = 0
    attention_sinks: int = 0
    # Some output row's logit mask comes from a grammar matcher (never served speculatively,
    # even when the matcher happens to allow every token).
    has_grammar: bool = False
    # More than 1: a multi-step request, up to this many decode steps in one pass (one input
    # token; its one output, on row 0, says how every step samples). The engine may run fewer,
    # never none; the result has one output per step run. See `Services.max_decode_steps`.
    steps: int = 1


@dataclass(slots=True)
class PassResult:
    outputs: list[OutputResult] = field(default_factory=list)


# The rule of `Services.generate`: given a step's result, (how many of its outputs it used, the
# next request or None to stop). A multi-step result whose later outputs went unused (a stop
# token came first) has the slots of those steps removed from the context.
NextStep = Callable[[PassResult], tuple[int, PassRequest | None]]


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str: ...


class Services(Protocol):
    """What a run may ask of the engine. `run_id` scopes ownership: `end_run` frees everything
    the run still holds (contexts, pages, adapters, staged speculation)."""

    @property
    def model(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def create_context(self, run_id: int) -> int: ...

    def fork_context(self, run_id: int, context_id: int) -> int: ...

    def context_length(self, run_id: int, context_id: int) -> int: ...

    def context_num_pages(self, run_id: int, context_id: int) -> int:
        """KV pages the context holds now (shared ones included)."""
        ...

    def truncate_context(self, run_id: int, context_id: int, length: int) -> None: ...

    def release_context(self, run_id: int, context_id: int) -> None: ...

    def release_slots(self, run_id: int, context_id: int, start: int, stop: int) -> int:
        """Release the whole pages inside slots [start, stop) (never the last page): their
        memory goes back to the pool, positions stay, and every later pass of the context must
        mask them out. Returns the number of pages released."""
        ...

    def forward(
        self, run_id: int, context_id: int, request: PassRequest, may_wait: Callable[[], None] | None = None
    ) -> PassResult:
        """Queue the pass, block until its batch returns. Input tokens become part of the
        context (its length grows by len(tokens)). `may_wait`, when given, is called while
        waiting (every 0.1 s); what it raises ends the wait (the pass goes on and its result is
        dropped with the context)."""
        ...

    def forward_group(
        self, run_id: int, passes: Sequence[tuple[int, PassRequest]], may_wait: Callable[[], None] | None = None
    ) -> list[PassResult | HostError]:
        """`forward` for several passes (of distinct contexts) at once: all are queued before any
        is scheduled, so they share device passes, and the call blocks until every one returns.
        One result per pass, in order: its `PassResult`, or the `HostError` that failed it (a
        failed pass does not stop the others). `forward_by_one` is the plain implementation."""
        ...

    def generate(self, run_id: int, context_id: int, first: PassRequest, next_step: NextStep) -> None:
        """A chain of passes: `first`, then each request `next_step` makes of the result before
        it, until it returns None. Blocks until then; raises the `HostError` of a step that
        failed (the steps before it stay in the context) or whatever `next_step` raised.
        `next_step` may run on any thread, with engine locks held: it must be quick and must
        not call back into the services. `generate_by_steps` is the plain implementation."""
        ...

    def max_decode_steps(self) -> int:
        """How many steps a multi-step request (`PassRequest.steps`) may usefully ask for now:
        1 when the driver cannot run them, or a pass already takes long enough that more steps
        per pass would only delay other requests and the client's stream."""
        ...

    def load_adapter(self, run_id: int, name: str) -> int: ...

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this driver's tokenizer (built on first use, then shared)."""
        ...

    def run_usage(self, run_id: int) -> tuple[int, int]:
        """(contexts, distinct KV pages) the run holds now: what it left when it ends."""
        ...

    def end_run(self, run_id: int) -> None: ...


def forward_by_one(
    services: Services,
    run_id: int,
    passes: Sequence[tuple[int, PassRequest]],
    may_wait: Callable[[], None] | None = None,
) -> list[PassResult | HostError]:
    """`Services.forward_group` as one `forward` after another (for services without a queue)."""
    results: list[PassResult | HostError] = []
    for context_id, request in passes:
        try:
            results.append(services.forward(run_id, context_id, request, may_wait))
        except HostError as exc:
            results.append(exc)
    return results


def generate_by_steps(
    services: Services, run_id: int, context_id: int, first: PassRequest, next_step: NextStep
) -> None:
    """`Services.generate` as a loop of `forward` calls on the caller's thread."""
    request: PassRequest | None = first
    while request is not None:
        result = services.forward(run_id, context_id, request)
        used, request = next_step(result)
        if used < len(result.outputs):  # the steps after the last one used leave the context
            length = services.context_length(run_id, context_id)
            services.truncate_context(run_id, context_id, length - (len(result.outputs) - used))
