"""The requesting side of a connection: assigns ids, pipelines requests, pairs replies.

Many requests may be in flight at once (the host builds the next pass while one runs); a reader
task routes each reply to its waiter by id. When the connection dies every waiter fails with
`ConnectionClosed`, so nothing hangs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio

from bridge_schema.codec import decode, encode
from bridge_schema.errors import BridgeError, ConnectionClosed, RemoteError
from bridge_schema.limits import Limits
from bridge_schema.messages import ErrorReply, Handshake, Hello, Message
from bridge_schema.transport import Connection

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Message)


class _Waiter:
    __slots__ = ("error", "event", "on_done", "reply")

    def __init__(self, on_done: Callable[[_Waiter], None] | None) -> None:
        self.event = anyio.Event()
        self.reply: Message | None = None
        self.error: BaseException | None = None
        self.on_done = on_done

    def finish(self) -> None:
        self.event.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # a failing callback must not stop the reader
                log.exception("reply callback failed")


class Client:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.limits: Limits | None = None
        self.handshake_reply: Handshake | None = None
        self._ids = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._closed: BaseException | None = None
        # Seconds spent encoding requests and decoding replies on this side (for benchmarks).
        self.encode_s = 0.0
        self.decode_s = 0.0

    @classmethod
    @asynccontextmanager
    async def open(cls, conn: Connection) -> AsyncIterator[Client]:
        client = cls(conn)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client._read_loop)
            try:
                yield client
            finally:
                tg.cancel_scope.cancel()
                # Shielded: a cancellation raised here would replace (and so swallow) whatever
                # exception the body is propagating.
                with anyio.CancelScope(shield=True):
                    await conn.aclose()
                client._fail_all(ConnectionClosed("client closed"))

    async def hello(self, hello: Hello) -> Handshake:
        reply = await self.request(hello, Handshake)
        self.limits = Limits.from_handshake(reply)
        self.handshake_reply = reply
        return reply

    async def request(self, message: Message, expect: type[R]) -> R:
        """Send `message` (its id is assigned here) and wait for its reply of type `expect`.
        Raises `RemoteError` for an error reply, `ConnectionClosed` if the link dies."""
        waiter = await self.submit(message)
        return await self.wait(waiter, expect)

    async def submit(self, message: Message, on_done: Callable[[_Waiter], None] | None = None) -> _Waiter:
        """Send `message`; `on_done(waiter)`, if given, runs in the reader as soon as the reply
        (or the link's failure) arrives, sparing the caller a task per request."""
        if self._closed is not None:
            raise ConnectionClosed(f"connection is closed: {self._closed}")
        message.id = next(self._ids)
        waiter = _Waiter(on_done)
        self._waiters[message.id] = waiter
        t0 = time.perf_counter()
        payload = encode(message)
        self.encode_s += time.perf_counter() - t0
        try:
            await self.conn.send_payload(payload)
        except BaseException:
            self._waiters.pop(message.id, None)
            raise
        return waiter

    async def wait(self, waiter: _Waiter, expect: type[R]) -> R:
        await waiter.event.wait()
        return self.result(waiter, expect)

    def result(self, waiter: _Waiter, expect: type[R]) -> R:
        """The reply of a finished waiter, raising as `wait` does."""
        if waiter.error is not None:
            raise waiter.error
        reply = waiter.reply
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply.status, reply.code, reply.field, reply.message)
        if not isinstance(reply, expect):
            raise BridgeError(f"expected {expect.__name__} reply, got {type(reply).__name__}")
        return reply

    async def _read_loop(self) -> None:
        try:
            while True:
                payload = await self.conn.receive_payload()
                t0 = time.perf_counter()
                reply = decode(payload, self.limits)
                self.decode_s += time.perf_counter() - t0
                waiter = self._waiters.pop(reply.id, None)
                if waiter is None:
                    log.warning("reply %s with unknown id %d dropped", type(reply).__name__, reply.id)
                    continue
                waiter.reply = reply
                waiter.finish()
        except BridgeError as exc:
            self._fail_all(exc if isinstance(exc, ConnectionClosed) else ConnectionClosed(f"bad reply: {exc}"))

    def _fail_all(self, error: BaseException) -> None:
        self._closed = error
        waiters, self._waiters = list(self._waiters.values()), {}
        for waiter in waiters:
            waiter.error = error
            waiter.finish()
