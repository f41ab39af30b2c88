"""The engine's loop thread: it opens the driver link, builds the core (host.engine.core) from
the handshake, and then drives only the core's verbs: page copies and the next batch out, each
reply back through `complete` (or `fail` / `isolate`), and the generations it hands back
continued once the lock is released.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import anyio.abc
import numpy as np

from bridge_schema.batch import build_forward, split_result
from bridge_schema.errors import BridgeError, RemoteError
from bridge_schema.messages import Ack, Copy, ForwardResult
from bridge_schema.transport import run as run_loop
from host.driver_link import DriverLink, open_link
from host.engine.config import EngineConfig
from host.engine.core import EngineCore
from host.engine.lock import EngineLock
from host.engine.pages import copy_groups
from host.engine.scheduler import Batch
from host.engine.speculation import build_core
from host.errors import DriverFailed, HostError

log = logging.getLogger("host.engine")
T = TypeVar("T")


class EngineLoop:
    """`start()` returns the core once the driver has handshaken; `stop()` joins the thread
    (after the core was asked to close)."""

    def __init__(self, config: EngineConfig, lock: EngineLock) -> None:
        self._config = config
        self._lock = lock
        self._core: EngineCore | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._link: DriverLink | None = None
        self._last_reply_at = 0.0  # perf_counter of the last pass reply
        self.schedule_s = 0.0  # building passes: scheduler + CSR packing
        self.complete_s = 0.0  # routing results back to runs
        self.num_passes = 0
        self._thread = threading.Thread(target=self._thread_main, name="wafer-engine", daemon=True)

    def start(self) -> EngineCore:
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._thread.join()
            error = self._startup_error
            raise error if isinstance(error, HostError) else DriverFailed(f"driver start failed: {error}")
        assert self._core is not None
        return self._core

    def stop(self) -> None:
        self.wake()
        self._thread.join()

    def wake(self) -> None:
        """From any thread: look for work now."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # the loop already stopped; close() and the loop's exit fail every waiter

    def call(self, make: Callable[[DriverLink], Coroutine[Any, Any, T]], what: str) -> T:
        """Run a bridge request on the loop from a run thread and wait for its reply."""
        assert self._core is not None and self._loop is not None and self._link is not None
        with self._lock:
            self._core.check_usable()
        try:
            return asyncio.run_coroutine_threadsafe(make(self._link), self._loop).result()
        except RemoteError as exc:
            raise DriverFailed(f"{what} failed: {exc}", exc.status, exc.code) from None
        except (BridgeError, concurrent.futures.CancelledError) as exc:
            raise DriverFailed(f"{what} failed: the driver link is gone ({exc})") from None

    def timing_stats(self) -> dict[str, float]:
        """Cumulative seconds of host work by stage, and passes sent (for benchmarks)."""
        client = self._link.client if self._link is not None else None
        return {
            "passes": float(self.num_passes),
            "schedule_s": self.schedule_s,
            "complete_s": self.complete_s,
            "encode_s": client.encode_s if client is not None else 0.0,
            "decode_s": client.decode_s if client is not None else 0.0,
        }

    # ------------------------------------------------------------------ the thread

    def _thread_main(self) -> None:
        try:
            run_loop(self._main)  # asyncio, on uvloop when installed
        except BaseException as caught:  # reported to start() or to every waiter
            exc = _first_host_error(caught)
            if not self._ready.is_set():
                self._startup_error = exc
            else:
                log.exception("engine loop failed")
                with self._lock:
                    assert self._core is not None
                    self._core.mark_broken(DriverFailed(f"engine loop failed: {exc}"))
        finally:
            if self._core is not None:
                with self._lock:
                    self._core.shut_down()
            self._ready.set()

    async def _main(self) -> None:
        async with open_link(self._config.driver_spec()) as link:
            self._core = build_core(self._config, link.handshake)
            self._lock.core = self._core
            self._link = link
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._ready.set()
            async with anyio.create_task_group() as tg:
                await self._schedule(self._core, link, tg)
                tg.cancel_scope.cancel()

    async def _schedule(self, core: EngineCore, link: DriverLink, tg: anyio.abc.TaskGroup) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if core.is_stopping:
                return
            while True:
                with self._lock:
                    copies = core.take_copies()
                    t0 = time.perf_counter()
                    batch = core.next_batch()
                    self.schedule_s += time.perf_counter() - t0
                for group in copy_groups(copies):
                    # Sent before the batch on the same connection: the driver handles frames in order.
                    message = Copy(
                        src_pages=np.array([c.src for c in group], np.uint32),
                        dst_pages=np.array([c.dst for c in group], np.uint32),
                    )
                    try:
                        tg.start_soon(self._check_copy, await link.submit(message), link)
                    except BridgeError as exc:
                        self._link_lost(core, DriverFailed(f"sending a page copy to the driver failed: {exc}"))
                        return
                if batch is None:
                    break
                t0 = time.perf_counter()
                forward = build_forward(0, batch.specs())
                self.schedule_s += time.perf_counter() - t0
                self.num_passes += 1
                try:
                    done = functools.partial(self._batch_done, core, link, batch, forward, time.perf_counter())
                    await link.submit(forward, done)
                except BridgeError as exc:
                    self._batch_failed(core, batch, DriverFailed(f"sending a pass to the driver failed: {exc}"), True)
                    return

    async def _check_copy(self, waiter: Any, link: DriverLink) -> None:
        try:
            await link.client.wait(waiter, Ack)
        except BridgeError as exc:
            # Contexts would read pages that were never copied: nothing after this is trustworthy.
            log.error("page copy failed: %s", exc)
            with self._lock:
                assert self._core is not None
                self._core.mark_broken(DriverFailed(f"the driver failed a page copy: {exc}"))
            self._wake_here()

    def _batch_done(
        self, core: EngineCore, link: DriverLink, batch: Batch, forward: Any, sent_at: float, waiter: Any
    ) -> None:
        """A pass's reply (or the link's failure) arrived: route it (in the link's reader)."""
        try:
            result = link.client.result(waiter, ForwardResult)
        except RemoteError as exc:
            if len(batch.chunks) > 1:
                with self._lock:
                    core.isolate(batch)
            else:
                error = DriverFailed(f"the driver rejected a pass: {exc}", exc.status, exc.code)
                self._batch_failed(core, batch, error, False)
        except BridgeError as exc:
            self._batch_failed(core, batch, DriverFailed(f"the driver link failed during a pass: {exc}"), True)
        else:
            t0 = time.perf_counter()
            # The driver runs passes in order: this one started when it was sent or when the one
            # before it ended, whichever came later. Time spent queued behind that one is not its own.
            elapsed = t0 - max(sent_at, self._last_reply_at)
            self._last_reply_at = t0
            outputs = split_result(forward, result)
            with self._lock:  # generations go on as it is released (grammar masks, output)
                core.complete(batch, outputs, elapsed)
            self.complete_s += time.perf_counter() - t0
        self._wake_here()

    def _batch_failed(self, core: EngineCore, batch: Batch, error: HostError, is_link_lost: bool) -> None:
        with self._lock:
            error = core.fail(batch, error)
        if is_link_lost:
            self._link_lost(core, error)
        self._wake_here()

    def _link_lost(self, core: EngineCore, error: HostError) -> None:
        with self._lock:
            core.break_link(error)

    def _wake_here(self) -> None:
        """`wake` from the loop thread itself: no self-pipe write needed."""
        assert self._wake is not None
        self._wake.set()


def _first_host_error(exc: BaseException) -> BaseException:
    """The `HostError` inside anyio's exception groups, if any: the message a caller can act on."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_host_error(inner)
            if isinstance(found, HostError):
                return found
    return exc
