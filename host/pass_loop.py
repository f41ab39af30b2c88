"""The engine's loop thread: it opens the driver link, builds passes from the scheduler and
sends them (page copies first), and routes each reply back. It shares the engine's state under
the engine's lock (host.engine is the one owner of that state; this module is its loop half).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import numpy as np

from bridge_schema.batch import build_forward, split_result
from bridge_schema.errors import BridgeError, RemoteError
from bridge_schema.messages import Ack, Copy, ForwardResult
from bridge_schema.transport import run as run_loop
from host.driver_link import DriverLink, open_link
from host.errors import DriverFailed, EngineClosed, HostError, InvalidRequest
from host.pages import copy_groups
from host.scheduler import Batch

if TYPE_CHECKING:
    from host.engine import Engine

log = logging.getLogger("host.engine")

# Two passes in flight: the driver works on one while the next is built and sent.
MAX_PASSES_IN_FLIGHT = 2


class PassLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last_reply_at = 0.0  # perf_counter of the last pass reply

    def thread_main(self) -> None:
        e = self.engine
        try:
            run_loop(self.main)  # asyncio, on uvloop when installed
        except BaseException as caught:  # reported to start() or to every waiter
            exc = _first_host_error(caught)
            if not e._ready.is_set():
                e._startup_error = exc
            else:
                log.exception("engine loop failed")
                with e._lock:
                    e._broken = e._broken or DriverFailed(f"engine loop failed: {exc}")
        finally:
            with e._lock:
                e._is_closing = True
                error = e._broken or EngineClosed("the engine closed while the pass waited")
                for future in e._futures.values():
                    future.set_exception(error)
                e._futures.clear()
            e._ready.set()

    async def main(self) -> None:
        e = self.engine
        async with open_link(e._spec) as link:
            e._on_handshake(link.handshake)
            e._link = link
            e._loop = asyncio.get_running_loop()
            e._wake = asyncio.Event()
            e._ready.set()
            async with anyio.create_task_group() as tg:
                await self.schedule_loop(link, tg)
                tg.cancel_scope.cancel()

    async def schedule_loop(self, link: DriverLink, tg: anyio.abc.TaskGroup) -> None:
        e = self.engine
        assert e._wake is not None
        while True:
            await e._wake.wait()
            e._wake.clear()
            if e._is_closing or e._broken is not None:
                return
            while True:
                with e._lock:
                    copies, e._pending_copies = e._pending_copies, []
                    batch = None
                    if e._num_in_flight < MAX_PASSES_IN_FLIGHT:
                        t0 = time.perf_counter()
                        batch = e._scheduler.next_batch()
                        e._schedule_s += time.perf_counter() - t0
                        if batch is None and e._num_in_flight == 0:
                            self.fail_unschedulable()
                    if batch is not None:
                        e._num_in_flight += 1
                        e._on_dispatched(batch)
                if copies:
                    # Sent before the batch on the same connection: the driver handles frames in order.
                    for group in copy_groups(copies):
                        message = Copy(
                            src_pages=np.array([c.src for c in group], np.uint32),
                            dst_pages=np.array([c.dst for c in group], np.uint32),
                        )
                        try:
                            tg.start_soon(self.check_copy, await link.submit(message), link)
                        except BridgeError as exc:
                            self.link_lost(DriverFailed(f"sending a page copy to the driver failed: {exc}"))
                            return
                if batch is None:
                    break
                t0 = time.perf_counter()
                forward = build_forward(0, batch.specs())
                e._schedule_s += time.perf_counter() - t0
                e._num_passes += 1
                try:
                    done = functools.partial(self.batch_done, link, batch, forward, time.perf_counter())
                    await link.submit(forward, done)
                except BridgeError as exc:
                    self.batch_failed(batch, DriverFailed(f"sending a pass to the driver failed: {exc}"), True)
                    return

    def fail_unschedulable(self) -> None:
        """Nothing in flight and nothing fits: fail what waits rather than let it wait forever
        (request checks make this unreachable; this is the guard against a hang)."""
        e = self.engine
        if e._scheduler.has_work():
            for item in e._scheduler.cancel(lambda p: True):
                e._fail_item(item, InvalidRequest("the pass does not fit the driver's per-pass limits"))

    async def check_copy(self, waiter: Any, link: DriverLink) -> None:
        e = self.engine
        try:
            await link.client.wait(waiter, Ack)
        except BridgeError as exc:
            # Contexts would read pages that were never copied: nothing after this is trustworthy.
            log.error("page copy failed: %s", exc)
            with e._lock:
                e._broken = e._broken or DriverFailed(f"the driver failed a page copy: {exc}")
            e._wake_here()

    def batch_done(self, link: DriverLink, batch: Batch, forward: Any, sent_at: float, waiter: Any) -> None:
        """A pass's reply (or the link's failure) arrived: route it (in the link's reader)."""
        e = self.engine
        try:
            result = link.client.result(waiter, ForwardResult)
        except RemoteError as exc:
            if len(batch.chunks) > 1:
                # Which request is bad is unknown: retry each alone so only that one fails.
                with e._lock:
                    e._num_in_flight -= 1
                    e._scheduler.isolate(batch)
            else:
                error = DriverFailed(f"the driver rejected a pass: {exc}", exc.status, exc.code)
                self.batch_failed(batch, error, False)
        except BridgeError as exc:
            self.batch_failed(batch, DriverFailed(f"the driver link failed during a pass: {exc}"), True)
        else:
            t0 = time.perf_counter()
            # The driver runs passes in order: this one started when it was sent or when the one
            # before it ended, whichever came later. Time spent queued behind that one is not its own.
            e._note_pass_time(batch, t0 - max(sent_at, self.last_reply_at))
            self.last_reply_at = t0
            outputs = split_result(forward, result)
            with e._lock:
                e._num_in_flight -= 1
                e._on_finished(e._scheduler.complete(batch, outputs))
            e._complete_s += time.perf_counter() - t0
        e._wake_here()

    def batch_failed(self, batch: Batch, error: HostError, is_link_lost: bool) -> None:
        e = self.engine
        with e._lock:
            if e._is_close_requested:  # the link went down because the engine is closing
                error = EngineClosed("the engine closed while the pass waited")
            e._num_in_flight -= 1
            for item in e._scheduler.fail(batch):
                e._fail_item(item, error)
        if is_link_lost:
            self.link_lost(error)
        e._wake_here()

    def link_lost(self, error: HostError) -> None:
        """Every waiting pass fails now; later calls fail with the same error."""
        e = self.engine
        with e._lock:
            e._broken = e._broken or error
            for item in e._scheduler.cancel(lambda p: True):
                e._fail_item(item, error)


def _first_host_error(exc: BaseException) -> BaseException:
    """The `HostError` inside anyio's exception groups, if any: the message a caller can act on."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_host_error(inner)
            if isinstance(found, HostError):
                return found
    return exc
