"""The one serve loop every driver runs: read a frame, decode and validate it against the
driver's handshake, dispatch, reply. A bad request gets an `ErrorReply` and the loop keeps
serving; only an oversized frame (the stream is then out of sync) closes its connection.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import dataclass, field

import anyio

from bridge_schema.codec import decode, encode, peek_id
from bridge_schema.errors import ConnectionClosed, FrameError, RangeError, SchemaError
from bridge_schema.framing import DEFAULT_MAX_FRAME_BYTES
from bridge_schema.limits import Limits
from bridge_schema.messages import (
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
from bridge_schema.transport import Connection, listen, parse_address, run
from drivers.deferred import DeferredTokens
from drivers.errors import DriverError
from drivers.protocol import Driver

log = logging.getLogger("drivers.serve")


@dataclass
class _ServeState:
    shutdown: anyio.Event
    limits: Limits | None = None
    deferred: DeferredTokens = field(default_factory=DeferredTokens)


def _error(request_id: int, status: Status, code: str, field: str, message: str) -> ErrorReply:
    return ErrorReply(id=request_id, status=int(status), code=code, field=field, message=message)


def handle(driver: Driver, state: _ServeState, message: Message) -> Message:
    """Dispatch one decoded request; always returns exactly one reply."""
    rid = message.id
    try:
        if isinstance(message, Hello):
            reply: Message = driver.handshake(message)
            assert isinstance(reply, Handshake)
            state.limits = Limits.from_handshake(reply)
            state.deferred = DeferredTokens()
        elif message.IS_REPLY:
            return _error(rid, Status.BAD_REQUEST, "schema", "t", f"{message.TAG!r} is a reply, not a request")
        elif isinstance(message, Health):
            stats = {**driver.health(), "deferred_tokens_filled": state.deferred.num_filled}
            reply = HealthReply(state="ok" if state.limits else "awaiting_hello", stats=stats)
        elif isinstance(message, Shutdown):
            reply = Ack()  # the serve loop stops once this reply is sent
        elif state.limits is None:
            return _error(rid, Status.NOT_READY, "not_ready", "t", f"send 'hello' before {message.TAG!r}")
        elif isinstance(message, Forward):
            try:
                forward = state.deferred.resolve(message)
                reply = driver.forward(forward)
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
    while not state.shutdown.is_set():
        try:
            payload = await conn.receive_payload()
        except FrameError as exc:
            await _try_send(conn, _error(0, Status.BAD_REQUEST, exc.code, "", str(exc)))
            break
        except ConnectionClosed:
            break
        try:
            message = decode(payload, state.limits)
        except SchemaError as exc:
            # Perhaps a pass whose contexts deferred requests would continue from: forget them all.
            state.deferred = DeferredTokens()
            status = Status.OUT_OF_RANGE if isinstance(exc, RangeError) else Status.BAD_REQUEST
            reply: Message = _error(peek_id(payload), status, exc.code, exc.field, str(exc))
        else:
            reply = handle(driver, state, message)
            if isinstance(message, Shutdown):
                await _try_send(conn, reply)
                state.shutdown.set()
                break
        if not await _try_send(conn, reply):
            break
    await conn.aclose()


async def _try_send(conn: Connection, reply: Message) -> bool:
    try:
        await conn.send_payload(encode(reply))
    except ConnectionClosed:
        return False
    return True


async def serve(driver: Driver, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
    """Serve `driver` at `address` until a `Shutdown` request or SIGINT/SIGTERM."""
    state = _ServeState(shutdown=anyio.Event())
    kind, where, _ = parse_address(address)
    if kind == "unix" and os.path.exists(where):
        os.unlink(where)  # a stale socket from a previous run

    async def on_connection(conn: Connection) -> None:
        await serve_connection(driver, conn, state)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: listen(
                    address, on_connection, max_frame_bytes, ready=lambda: log.info("listening on %s", address)
                )
            )
            tg.start_soon(_watch_signals, state)
            await state.shutdown.wait()
            tg.cancel_scope.cancel()
    finally:
        if kind == "unix" and os.path.exists(where):
            os.unlink(where)


async def _watch_signals(state: _ServeState) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            state.shutdown.set()
            return


def serve_forever(driver: Driver, address: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
    """Blocking entry point for a driver's `__main__`."""
    run(serve, driver, address, max_frame_bytes)


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
