"""Pass-level speculation as a layer around the engine core: `SpeculativeCore` is the core with
`submit` and `next_batch` wrapped, and nothing inside the core knows of it.

- `submit`: a request that a staged pass serves takes that pass (and its reserved slot) instead
  of being queued; any other is queued with a `ColdPass` waiter, which stages the context's next
  step once its result is handed over.
- `next_batch`: the step after each decode in the batch is staged as the batch goes out, to
  follow it at the driver with its input token deferred (`drivers.serve` fills it in for every
  driver; a driver that does not advertise it gets no speculation).
- staged passes enter the core through `EngineCore.enqueue` with their `StagedPass` as waiter, so
  their results and errors come back the way every pass's do; a context's fork, truncation,
  punch or release drops its chain (`Contexts.subscribe`).

The decisions (what may be staged, what a staged pass may serve) are host.engine.speculator's; the
moving of passes and results is host.engine.staging's.
"""

from __future__ import annotations

import logging

from bridge_schema.messages import DEFERRED_TOKENS, Handshake
from host.engine.config import EngineConfig
from host.engine.core import EngineCore
from host.engine.passes import Waiter
from host.engine.scheduler import Batch
from host.engine.staging import Staging
from host.services import PassRequest, PassResult

_log = logging.getLogger("wafer.engine")


class SpeculativeCore(EngineCore):
    def __init__(self, config: EngineConfig, handshake: Handshake) -> None:
        super().__init__(config, handshake)
        self.staging = Staging(config.speculation_depth, self.pages, self, may_reserve=self.contexts.may_reserve)
        self.contexts.subscribe(self.staging.invalidate)

    def submit(self, run_id: int, context_id: int, request: PassRequest, waiter: Waiter) -> PassResult | None:
        """Queue one pass, or answer it from a staged pass: then the result, if that pass has
        returned already, else None and `waiter` gets it when it does."""
        item = self.check_pass(run_id, context_id, request)
        staged = self.staging.take(context_id, item.shape)
        if staged is not None:
            self.contexts.adopt_reserved(context_id, item)
            if staged.result is None:
                staged.waiter = waiter
            self.staging.after_served(staged)  # its next step goes now if it is sent
            return staged.result
        if not item.outputs:  # nothing sampled: nothing to stage after it
            self.queue(item, waiter)
            return None
        cold = self.staging.watch(waiter)
        cold.item = self.queue(item, cold)
        return None

    def next_batch(self) -> Batch | None:
        batch = super().next_batch()
        if batch is not None:
            for chunk in batch.chunks:
                if chunk.is_last and not chunk.item.is_cancelled:
                    self.staging.on_dispatched(chunk.item)
        return batch

    def speculation_stats(self) -> dict[str, int]:
        return self.staging.stats()


def build_core(config: EngineConfig, handshake: Handshake) -> EngineCore:
    """The engine core for `config`: with pass-level speculation around it unless its depth is 0
    or the driver cannot fill in deferred tokens (one that does not run on `drivers.serve`)."""
    if config.speculation_depth <= 0:
        return EngineCore(config, handshake)
    if DEFERRED_TOKENS not in handshake.capabilities:
        _log.warning(
            "driver %s does not fill in deferred tokens (drivers.serve does it for every driver): "
            "pass-level speculation is off",
            handshake.model_name,
        )
        return EngineCore(config, handshake)
    return SpeculativeCore(config, handshake)
