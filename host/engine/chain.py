"""Host-side generation (`Engine.generate`): one chain of passes of one context, each step's
request made from the last step's result by the API layer's `next_step`, with no thread hop
and no guest call per token.

`next_step` fills grammar bitmasks, checks stop tokens and writes output: it runs with the
engine's lock released (a step's result is handed over as the lock is let go: on the loop thread
when a pass returns, on the run thread for the first step), and the lock is taken only to hand
its request to the core.
"""

from __future__ import annotations

import concurrent.futures

from host.engine.core import EngineCore
from host.engine.lock import EngineLock
from host.services import NextStep, PassRequest, PassResult


class Chain:
    """The waiter of each step of one generation in turn."""

    def __init__(self, core: EngineCore, lock: EngineLock, run_id: int, context_id: int, next_step: NextStep) -> None:
        self._core = core
        self._lock = lock
        self._run_id = run_id
        self._context_id = context_id
        self._next_step = next_step
        self.finished: concurrent.futures.Future[None] = concurrent.futures.Future()

    def start(self, first: PassRequest) -> None:
        """Submit the first step (lock not held); the caller wakes the loop, then waits on
        `finished`."""
        try:
            with self._lock:
                served = self._core.submit(self._run_id, self._context_id, first, self)
        except BaseException as exc:
            self.set_exception(exc)
            return
        if served is not None:
            self.continue_from(served)

    # ------------------------------------------------------------------ Waiter (lock free)

    def set_result(self, result: PassResult) -> None:
        self.continue_from(result)

    def set_exception(self, exception: BaseException) -> None:
        if not self.finished.done():
            self.finished.set_exception(exception)

    def done(self) -> bool:
        return self.finished.done()

    def continue_from(self, result: PassResult) -> None:
        """Submit the steps that follow `result` until one has to wait for the driver, or the
        caller's rule says stop."""
        try:
            while True:
                used, request = self._next_step(result)
                with self._lock:
                    if used < len(result.outputs):
                        self._core.drop_unused_steps(self._context_id, len(result.outputs) - used)
                    if request is None:
                        break
                    served = self._core.submit(self._run_id, self._context_id, request, self)
                if served is None:
                    return
                result = served
        except BaseException as exc:  # HostError from a refused step, or the rule's own failure
            self.set_exception(exc)
            return
        self.finished.set_result(None)
