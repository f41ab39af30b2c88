"""The engine's lock, and who gives out the outcomes the core collected under it."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from host.engine.passes import resolve

if TYPE_CHECKING:
    from host.engine.core import EngineCore


class EngineLock:
    """Held around every core verb (`with lock:`). Whoever releases it then hands over the
    results and errors the core collected meanwhile (`EngineCore.take_handovers`): a run
    thread woken by its result never waits for the lock the result came from, and a waiter's
    code (a generation's next step, grammar masks) never runs under it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.core: EngineCore | None = None  # set once the driver's handshake built it

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *_exc: object) -> None:
        handovers = self.core.take_handovers() if self.core is not None else []
        self._lock.release()
        resolve(handovers)
