"""The one serve loop every driver runs: read a frame, decode and validate it against the
driver's handshake, dispatch, reply. A bad request gets an `ErrorReply` and the loop keeps
serving; only an oversized frame (the stream is then out of sync) closes its connection.
A listening driver serves one host connection at a time (`drivers.host_slot`), each on a serve
state of its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import anyio
import anyio.abc

from bridge_schema.codec import decode, encode, peek_id
from bridge_schema.errors import ConnectionClosed, FrameError, RangeError, SchemaError
from bridge_schema.framing import DEFAULT_MAX_FRAME_BYTES
from bridge_schema.limits import Limits
from bridge_schema.messages import (
    DEFERRED_TOKENS,
    MULTI_STEP,
    Ack,
    Adapter,
    Copy,
    ErrorReply,
    Forward,
    ForwardResult,
    Handshake,
    Health,
    HealthReply,
    Hello,
    Message,
    Shutdown,
    Status,
)
from bridge_schema.transport import (
    DRIVER_BUSY,
    HOST_PID_ENV,
    Connection,
    ProtocolConnection,
    listen,
    parse_address,
    run,
)
from drivers.deferred import DeferredTokens
from drivers.errors import DriverError
from drivers.host_slot import HostSlot, describe_peer
from drivers.multistep import run_steps
from drivers.protocol import Driver
from drivers.timing import DueTimer

log = logging.getLogger("drivers.serve")

# How long a connection's first request waits for the host being served to let go of the driver
# before it is refused: a host that has just disconnected holds it until its serve task has wound
# down (a pass it left in flight finishes first).
RELEASE_WAIT_S = 1.0


@dataclass
class _ServeState:
    """One host connection's state; `shutdown` is the driver's, shared by every connection."""

    shutdown: anyio.Event
    limits: Limits | None = None
    deferred: DeferredTokens = field(default_factory=DeferredTokens)
    adapters: set[int] = field(default_factory=set)  # loaded by this host, unloaded when it goes


def _error(request_id: int, status: Status, code: str, field: str, message: str) -> ErrorReply:
    return ErrorReply(id=request_id, status=int(status), code=code, field=field, message=message)


def handle(driver: Driver, state: _ServeState, message: Message) -> Message:
    """Dispatch one decoded request; always returns exactly one reply."""
    rid = message.id
    try:
        if isinstance(message, Hello):
            reply: Message = driver.handshake(message)
            assert isinstance(reply, Handshake)
            # Run here for every driver (`drivers.multistep`, `drivers.deferred`).
            reply.capabilities = [
                *reply.capabilities,
                *(c for c in (MULTI_STEP, DEFERRED_TOKENS) if c not in reply.capabilities),
            ]
            state.limits = Limits.from_handshake(reply)
            state.deferred = DeferredTokens()
        elif message.IS_REPLY:
            return _error(rid, Status.BAD_REQUEST, "schema", "t", f"{message.TAG!r} is a reply, not a request")
        elif isinstance(message, Health):
            stats = {**driver.health(), "deferred_tokens_filled": state.deferred.num_filled, "pid": os.getpid()}
            reply = HealthReply(state="ok" if state.limits else "awaiting_hello", stats=stats)
        elif isinstance(message, Shutdown):
            reply = Ack()  # the serve loop stops once this reply is sent
        elif state.limits is None:
            return _error(rid, Status.NOT_READY, "not_ready", "t", f"send 'hello' before {message.TAG!r}")
        elif isinstance(message, Forward):
            try:
                forward = state.deferred.resolve(message)
                reply = run_steps(driver.forward, forward, state.limits.page_size)
            except BaseException:
                state.deferred.forget(message)
                raise
            assert isinstance(reply, ForwardResult)
            state.deferred.record(forward, reply)
        elif isinstance(message, Copy):
            driver.copy(message)
            reply = Ack()
        elif isinstance(message, Adapter):
            driver.adapter(message)
            if message.op == "load":
                state.adapters.add(message.adapter_id)
            else:
                state.adapters.discard(message.adapter_id)
            reply = Ack()
        else:  # pragma: no cover - every request type is dispatched above
            return _error(rid, Status.BAD_REQUEST, "schema", "t", f"unhandled message {message.TAG!r}")
    except DriverError as exc:
        return _error(rid, exc.status, exc.code, exc.field, str(exc))
    except Exception as exc:  # a driver bug must not take the process down
        log.exception("driver failed on %s %d", message.TAG, rid)
        return _error(rid, Status.INTERNAL, "internal", "", f"{type(exc).__name__}: {exc}")
    reply.id = rid
    return reply


async def serve_connection(driver: Driver, conn: Connection, state: _ServeState) -> None:
    """Read, decode, handle and reply, one frame at a time, in order. A driver that models a
    device queue (`reply_at`, see `drivers.protocol`) has its replies sent by a writer task at
    their due time, while this loop goes on reading and handling the frames behind them."""
    outbox_in, outbox_out = anyio.create_memory_object_stream[tuple[Message, float]](max_buffer_size=64)
    is_shutdown = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_write_due_replies, conn, outbox_out)
            try:
                is_shutdown = await _read_and_handle(driver, conn, state, outbox_in)
            finally:
                outbox_in.close()  # the writer sends what is queued, then ends
    finally:
        outbox_in.close()
        outbox_out.close()
        with anyio.CancelScope(shield=True):  # closed even when the serving task is cancelled
            await conn.aclose()
        _unload_adapters(driver, state)
    if is_shutdown:  # its Ack is sent: stop serving
        state.shutdown.set()


def _unload_adapters(driver: Driver, state: _ServeState) -> None:
    """A host's adapters go with its connection: the next host's adapter ids name only what it
    loaded itself, and the memory is free for it."""
    for adapter_id in sorted(state.adapters):
        try:
            driver.adapter(Adapter(op="unload", adapter_id=adapter_id))
        except Exception:  # one that will not unload must not keep the others loaded
            log.exception("unloading adapter %d of a host that disconnected failed", adapter_id)
    state.adapters.clear()


async def _read_and_handle(
    driver: Driver, conn: Connection, state: _ServeState, outbox: anyio.abc.ObjectSendStream[tuple[Message, float]]
) -> bool:
    """The reading half of `serve_connection`; True once a `Shutdown` has been answered."""
    while not state.shutdown.is_set():
        try:
            payload = await conn.receive_payload()
        except FrameError as exc:
            await outbox.send((_error(0, Status.BAD_REQUEST, exc.code, "", str(exc)), 0.0))
            return False
        except ConnectionClosed:
            return False
        is_shutdown = False
        try:
            message = decode(payload, state.limits)
        except SchemaError as exc:
            # Perhaps a pass whose contexts deferred requests would continue from: forget them all.
            state.deferred = DeferredTokens()
            status = Status.OUT_OF_RANGE if isinstance(exc, RangeError) else Status.BAD_REQUEST
            reply: Message = _error(peek_id(payload), status, exc.code, exc.field, str(exc))
        else:
            reply = handle(driver, state, message)
            is_shutdown = isinstance(message, Shutdown)
        # Once a driver has given a due time, every reply goes through the writer, in order.
        reply_at: float | None = getattr(driver, "reply_at", None)
        if reply_at is None and not is_shutdown:
            if not await _try_send(conn, reply):
                return False
        else:
            await outbox.send((reply, reply_at if isinstance(reply, ForwardResult) and reply_at else 0.0))
        if is_shutdown:
            return True
    return False


async def _write_due_replies(conn: Connection, replies: anyio.abc.ObjectReceiveStream[tuple[Message, float]]) -> None:
    """Send queued replies in order, each no earlier than its due time (perf_counter seconds)."""
    timer = DueTimer()  # the event loop's own timers round to milliseconds
    try:
        async for reply, due in replies:
            await timer.wait_until(due)
            if not await _try_send(conn, reply):
                return
    finally:
        timer.close()


async def _try_send(conn: Connection, reply: Message) -> bool:
    try:
        await conn.send_payload(encode(reply))
    except ConnectionClosed:
        return False
    return True


async def serve_host(driver: Driver, conn: ProtocolConnection, slot: HostSlot, shutdown: anyio.Event) -> None:
    """Serve `conn` on a fresh serve state if no other host holds `slot`; else answer its first
    request with a `DRIVER_BUSY` error naming the holder, and close it. A connection takes the
    slot with its first frame, so one that sends nothing (a probe that the driver listens) takes
    nothing."""
    try:
        first = await conn.receive_payload()
    except ConnectionClosed:
        await conn.aclose()
        return
    except FrameError as exc:
        await _try_send(conn, _error(0, Status.BAD_REQUEST, exc.code, "", str(exc)))
        await conn.aclose()
        return
    peer = describe_peer(conn)
    if not await slot.wait_released(RELEASE_WAIT_S):
        refusal = slot.refusal()
        log.warning("refused %s: %s", peer, refusal)
        await _try_send(conn, _error(peek_id(first), Status.NOT_READY, DRIVER_BUSY, "", refusal))
        await conn.aclose()
        return
    slot.take(peer)  # no await since `wait_released` said it is free: no other host takes it first
    log.info("serving %s", peer)
    try:
        await serve_connection(driver, _FirstPayload(conn, first), _ServeState(shutdown=shutdown))
    finally:
        slot.release()


class _FirstPayload:
    """A connection whose first payload was read already (to decide whether to serve it)."""

    def __init__(self, conn: Connection, first: bytes) -> None:
        self._conn = conn
        self._first: bytes | None = first

    async def send_payload(self, payload: bytes) -> None:
        await self._conn.send_payload(payload)

    async def receive_payload(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._conn.receive_payload()

    async def aclose(self) -> None:
        await self._conn.aclose()


async def serve(driver: Driver, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
    """Serve `driver` at `address`, one host at a time, until a `Shutdown` request or SIGINT/SIGTERM."""
    shutdown = anyio.Event()
    slot = HostSlot()
    kind, where, _ = parse_address(address)
    if kind == "unix" and os.path.exists(where):
        os.unlink(where)  # a stale socket from a previous run

    async def on_connection(conn: ProtocolConnection) -> None:
        await serve_host(driver, conn, slot, shutdown)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: listen(
                    address, on_connection, max_frame_bytes, ready=lambda: log.info("listening on %s", address)
                )
            )
            tg.start_soon(_watch_signals, shutdown)
            await shutdown.wait()
            tg.cancel_scope.cancel()
    finally:
        if kind == "unix" and os.path.exists(where):
            os.unlink(where)


async def _watch_signals(shutdown: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            shutdown.set()
            return


def serve_forever(driver: Driver, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
    """Blocking entry point for a driver's `__main__`. Started by a host that owns it (HOST_PID_ENV
    set), the process exits once that host is gone."""
    host = os.environ.pop(HOST_PID_ENV, "")  # not inherited by what this driver starts
    if host.isdigit():
        threading.Thread(target=_exit_without_host, args=(int(host),), name="wafer-host-watch", daemon=True).start()
    run(serve, driver, address, max_frame_bytes)


def _exit_without_host(pid: int, poll_s: float = 0.5) -> None:
    # A process whose parent dies is handed to another (init, or a subreaper).
    while os.getppid() == pid:
        time.sleep(poll_s)
    log.warning("the host that started this driver (pid %d) is gone: exiting", pid)
    os._exit(3)


async def serve_loopback(driver: Driver, conn: Connection) -> None:
    """Serve one in-process loopback connection (see `bridge_schema.transport.loopback_pair`).

    A host runs a driver in-process by importing its package by name at run time (never
    statically) and calling `create_driver(argv)` from the package's `__main__` module, then this.
    """
    await serve_connection(driver, conn, _ServeState(shutdown=anyio.Event()))


def add_serve_arguments(parser: argparse.ArgumentParser, listen_required: bool = True) -> None:
    parser.add_argument("--listen", required=listen_required, help="unix:PATH or tcp:HOST:PORT")
    parser.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES)
    parser.add_argument("--log-level", default="INFO")


def configure_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
