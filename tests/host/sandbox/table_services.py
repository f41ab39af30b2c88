"""A small in-process `Services` for the sandbox isolation tests only: real tables of contexts,
the real bytes tokenizer, and a deterministic next-token rule instead of a model. End-to-end
tests of inferlets use the real engine and the dummy driver (tests/e2e)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from bridge_schema.batch import OutputResult
from host.errors import ContextNotFound, ContextNotOwned, HostError, InvalidRequest, OutOfPages
from host.services import ModelInfo, NextStep, PassRequest, PassResult, forward_by_one, generate_by_steps
from host.tokenizer import BytesTokenizer

VOCAB_SIZE = 260
STOP_TOKEN = 257


class TableServices:
    """Thread-safe. The token sampled after `t` is `t + 1` (mod 256), so outputs are checkable.
    `max_contexts` bounds live contexts (OutOfPages beyond it)."""

    def __init__(self, max_contexts: int = 10_000, forward_delay_s: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._next_id = 1
        self._contexts: dict[int, tuple[int, list[int]]] = {}  # id -> (run_id, tokens)
        self._max_contexts = max_contexts
        self._forward_delay_s = forward_delay_s
        self._tokenizer = BytesTokenizer(VOCAB_SIZE)
        self.ended_runs: list[int] = []
        self.num_released = 0
        self.num_forwards = 0
        self.forward_started = threading.Event()

    @property
    def model(self) -> ModelInfo:
        return ModelInfo("table-model", VOCAB_SIZE, 4, 4096, (STOP_TOKEN,), (256, 257, 258, 259))

    @property
    def tokenizer(self) -> BytesTokenizer:
        return self._tokenizer

    def live_contexts(self, run_id: int | None = None) -> list[int]:
        with self._lock:
            return [c for c, (r, _) in self._contexts.items() if run_id is None or r == run_id]

    def _ctx(self, run_id: int, context_id: int) -> list[int]:
        entry = self._contexts.get(context_id)
        if entry is None:
            raise ContextNotFound(context_id)
        if entry[0] != run_id:
            raise ContextNotOwned(context_id, run_id)
        return entry[1]

    def _new(self, run_id: int, tokens: list[int]) -> int:
        if len(self._contexts) >= self._max_contexts:
            raise OutOfPages(1, 0, self._max_contexts, 4)
        cid = self._next_id
        self._next_id += 1
        self._contexts[cid] = (run_id, tokens)
        return cid

    def create_context(self, run_id: int) -> int:
        with self._lock:
            return self._new(run_id, [])

    def fork_context(self, run_id: int, context_id: int) -> int:
        with self._lock:
            return self._new(run_id, list(self._ctx(run_id, context_id)))

    def context_length(self, run_id: int, context_id: int) -> int:
        with self._lock:
            return len(self._ctx(run_id, context_id))

    def context_num_pages(self, run_id: int, context_id: int) -> int:
        with self._lock:  # no pages in a table
            self._ctx(run_id, context_id)
            return 0

    def truncate_context(self, run_id: int, context_id: int, length: int) -> None:
        with self._lock:
            tokens = self._ctx(run_id, context_id)
            if length > len(tokens):
                raise InvalidRequest(f"cannot truncate {len(tokens)} tokens to {length}")
            del tokens[length:]

    def release_context(self, run_id: int, context_id: int) -> None:
        with self._lock:
            self._ctx(run_id, context_id)
            del self._contexts[context_id]
            self.num_released += 1

    def forward(
        self, run_id: int, context_id: int, request: PassRequest, may_wait: Callable[[], None] | None = None
    ) -> PassResult:
        self.forward_started.set()
        if self._forward_delay_s:
            threading.Event().wait(self._forward_delay_s)
        with self._lock:
            tokens = self._ctx(run_id, context_id)
            tokens.extend(int(t) for t in request.tokens)
            self.num_forwards += 1
            inputs: Sequence[int] = list(request.tokens)
            return PassResult([OutputResult(token=(inputs[o.row] + 1) % 256) for o in request.outputs])

    def forward_group(
        self, run_id: int, passes: Sequence[tuple[int, PassRequest]], may_wait: Callable[[], None] | None = None
    ) -> list[PassResult | HostError]:
        return forward_by_one(self, run_id, passes, may_wait)

    def generate(self, run_id: int, context_id: int, first: PassRequest, next_step: NextStep) -> None:
        generate_by_steps(self, run_id, context_id, first, next_step)

    def max_decode_steps(self) -> int:
        return 1

    def load_adapter(self, run_id: int, name: str) -> int:
        raise InvalidRequest(f"no adapter named {name!r}")

    def run_usage(self, run_id: int) -> tuple[int, int]:
        with self._lock:  # no pages in a table
            return sum(1 for r, _ in self._contexts.values() if r == run_id), 0

    def end_run(self, run_id: int) -> None:
        with self._lock:
            self.ended_runs.append(run_id)
            for cid in [c for c, (r, _) in self._contexts.items() if r == run_id]:
                del self._contexts[cid]
