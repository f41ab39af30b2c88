"""`Pass`: one inferlet forward pass, the one shape it has on the host from the check where it
enters (host.engine.pass_check) to the driver pass it goes out in (host.engine.scheduler), staged
ones included (host.engine.staging). Its speculation features (`shape`) are a property of it, not
another copy; `Waiter`, who gets its result.

Pure data: no pages, no clock, no threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from bridge_schema.batch import OutputResult, OutputSpec
from host.engine.speculator import RequestShape
from host.services import PassResult


class Waiter(Protocol):
    """Who gets a pass's result or error: a run thread's future, or a host-side generation's
    chain (host.engine.chain). The engine core hands it over once its lock is released
    (`EngineCore.take_handovers`), so no waiter's code runs under the lock; the staging layer's
    own relays (`under_lock`), which move results between passes, run at once under it."""

    def set_result(self, result: PassResult) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...

    def done(self) -> bool: ...


Outcome = PassResult | BaseException
Handover = tuple[Waiter, Outcome]


def resolve(handovers: list[Handover]) -> None:
    """Give each waiter its outcome (a waiter already done keeps its first)."""
    for waiter, outcome in handovers:
        if waiter.done():
            continue
        if isinstance(outcome, BaseException):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)


@dataclass(eq=False, slots=True, kw_only=True)
class Pass:
    """What to compute (checked against the handshake), where (placed by the engine core: the
    context's slots kv_start .. kv_start + len(tokens), held by `pages`), and how far it got."""

    tokens: npt.NDArray[np.uint32]
    positions: npt.NDArray[np.uint32]
    outputs: tuple[OutputSpec, ...] = ()
    mask_rows: Sequence[Sequence[int]] | None = None
    adapter_id: int = -1
    # Some output row's logit mask comes from a grammar matcher (never served speculatively).
    has_grammar: bool = False
    # A multi-step request: one token, `outputs[0]` sampling at each of `steps` decode steps,
    # whose slots kv_start .. kv_start + steps it holds (`Forward.steps`).
    steps: int = 1
    # Its first token is what the context's previous pass samples (`Forward.deferred`): it may
    # go to the driver while that pass is still in flight.
    deferred: bool = False

    # placement
    ticket: int = 0
    run_id: int = 0
    context_id: int = 0
    pages: tuple[int, ...] = ()
    kv_start: int = 0

    # progress
    num_done: int = 0  # tokens whose chunks have returned
    is_sent: bool = False  # its last chunk is in flight
    results: list[OutputResult] = field(default_factory=list)
    is_cancelled: bool = False
    is_isolated: bool = False  # its batch was refused: retry it alone to find the culprit

    @property
    def num_remaining(self) -> int:
        return len(self.tokens) - self.num_done

    @property
    def shape(self) -> RequestShape:
        """The features the speculator judges a request by (host.engine.speculator.RULES)."""
        positions = self.positions
        contiguous = len(positions) < 2 or bool((np.diff(positions.astype(np.int64)) == 1).all())
        return RequestShape(
            tokens=tuple(self.tokens.tolist()),  # in C: a long prefill passes through here on the loop thread
            position=int(positions[0]),
            outputs=self.outputs,
            adapter_id=self.adapter_id,
            has_grammar=self.has_grammar,
            has_attention_mask=self.mask_rows is not None,
            explicit_positions_contiguous=contiguous,
            steps=self.steps,
        )
