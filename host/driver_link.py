"""The link to a driver: start one (a subprocess on a Unix socket, or in-process over loopback)
or connect to an address, then say `Hello` and read its `Handshake`.

The host never imports `drivers` statically: a driver is named by module and started with
`python -m MODULE`, or imported by name at run time for loopback (which still encodes frames).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from bridge_schema.client import Client
from bridge_schema.errors import BridgeError, RemoteError
from bridge_schema.messages import Ack, Handshake, Hello, Message, Shutdown
from bridge_schema.transport import DRIVER_BUSY, Connection, connect, loopback_pair, parse_address
from host.driver_process import driver_argv, output_tail, owned_driver_env, socket_path, stop_process
from host.errors import DriverFailed, InvalidRequest

log = logging.getLogger(__name__)

BUILTIN_DRIVERS = ("dummy", "torch")


@dataclass(frozen=True, slots=True)
class DriverSpec:
    """Which driver to use. `driver` is a builtin name (started as a subprocess), "loopback"
    (in-process), or an address "unix:PATH" / "tcp:HOST:PORT" of a running driver.
    `module` names the driver module to start or import (default: `drivers.<name>`, and
    `drivers.dummy` for loopback); `args` are its command-line options (e.g. --num-pages 64)."""

    driver: str = "dummy"
    args: tuple[str, ...] = ()
    module: str = ""
    startup_timeout_s: float = 60.0
    hello: Hello = field(default_factory=Hello)

    @property
    def kind(self) -> str:
        if self.driver == "loopback":
            return "loopback"
        if self.driver.startswith(("unix:", "tcp:")):
            return "address"
        if self.driver in BUILTIN_DRIVERS or self.module:
            return "process"
        raise InvalidRequest(
            f"unknown driver {self.driver!r}: use one of {', '.join(BUILTIN_DRIVERS)}, loopback, "
            f"unix:PATH or tcp:HOST:PORT"
        )

    @property
    def module_name(self) -> str:
        if self.module:
            return self.module
        return "drivers.dummy" if self.driver == "loopback" else f"drivers.{self.driver}"


R = TypeVar("R", bound=Message)


@dataclass(slots=True)
class DriverLink:
    """An open, handshaken connection. `client` pipelines requests (bridge_schema.client)."""

    client: Client
    handshake: Handshake
    description: str

    async def submit(self, message: Message, on_done: Callable[[Any], None] | None = None) -> Any:
        """Send a request; returns the waiter for `client.wait` (or pass `on_done`)."""
        return await self.client.submit(message, on_done)

    async def request(self, message: Message, expect: type[R]) -> R:
        return await self.client.wait(await self.submit(message), expect)


@asynccontextmanager
async def open_link(spec: DriverSpec) -> AsyncIterator[DriverLink]:
    """Start or reach the driver, handshake, and yield the link; on exit the driver we started
    is shut down (asked first, then terminated)."""
    kind = spec.kind
    if kind == "loopback":
        async with _loopback(spec) as link:
            yield link
    elif kind == "address":
        parse_address(spec.driver)  # a bad address fails here with a clear FieldError message
        conn = await _connect(spec.driver)
        async with _handshaken(conn, spec, spec.driver) as link:
            yield link
    else:
        async with _subprocess(spec) as link:
            yield link


async def _connect(address: str) -> Connection:
    try:
        return await connect(address)
    except BridgeError as exc:
        raise DriverFailed(f"cannot reach the driver at {address}: {exc}") from None


@asynccontextmanager
async def _handshaken(conn: Connection, spec: DriverSpec, description: str) -> AsyncIterator[DriverLink]:
    async with Client.open(conn) as client:
        try:
            with anyio.fail_after(spec.startup_timeout_s):
                handshake = await client.hello(spec.hello)
        except TimeoutError:
            raise DriverFailed(f"driver {description} sent no handshake in {spec.startup_timeout_s:g} s") from None
        except RemoteError as exc:
            if exc.code == DRIVER_BUSY:  # its message names the host that holds the driver
                raise DriverFailed(f"the driver at {description} is busy: {exc.detail}", exc.status, exc.code) from None
            raise DriverFailed(f"driver {description} refused the hello: {exc}", exc.status, exc.code) from None
        except BridgeError as exc:
            raise DriverFailed(f"handshake with driver {description} failed: {exc}") from None
        yield DriverLink(client, handshake, description)


@asynccontextmanager
async def _subprocess(spec: DriverSpec) -> AsyncIterator[DriverLink]:
    workdir = tempfile.mkdtemp(prefix="wafer-driver-")
    address = f"unix:{os.path.join(workdir, 'driver.sock')}"
    log_path = os.path.join(workdir, "driver.log")
    argv = driver_argv(spec.module_name, address, spec.args)
    description = f"{spec.module_name} (pid pending)"
    with open(log_path, "wb") as log_file:
        # stderr goes to a file: a pipe nobody reads would stall a chatty driver.
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=owned_driver_env()
        )
    description = f"{spec.module_name} (pid {proc.pid})"
    try:
        conn = await _wait_for_socket(proc, address, log_path, spec.startup_timeout_s)
        async with _handshaken(conn, spec, description) as link:
            try:
                yield link
            finally:
                await _ask_shutdown(link)
    finally:
        with anyio.CancelScope(shield=True):  # reaped even when the caller was cancelled
            await anyio.to_thread.run_sync(functools.partial(stop_process, proc, exit_grace_s=2.0, terminate_s=2.0))
        shutil.rmtree(workdir, ignore_errors=True)


async def _wait_for_socket(proc: subprocess.Popen[bytes], address: str, log_path: str, timeout_s: float) -> Connection:
    path = socket_path(address)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = output_tail(log_path)
            raise DriverFailed(f"driver exited with status {proc.returncode} before listening:\n{tail}")
        if os.path.exists(path):
            try:
                return await connect(address)
            except BridgeError:
                pass  # the socket file exists a moment before it accepts
        if time.monotonic() > deadline:
            raise DriverFailed(f"driver did not listen on {address} within {timeout_s:g} s:\n{output_tail(log_path)}")
        await anyio.sleep(0.02)


async def _ask_shutdown(link: DriverLink) -> None:
    try:
        with anyio.move_on_after(2.0):
            await link.request(Shutdown(), Ack)
    except BridgeError:
        pass  # already gone: stop_process makes sure


# ---------------------------------------------------------------------- loopback


@asynccontextmanager
async def _loopback(spec: DriverSpec) -> AsyncIterator[DriverLink]:
    driver = build_driver(spec.module_name, spec.args)
    serve = importlib.import_module("drivers.serve")  # by name: the host never imports drivers
    host_end, driver_end = loopback_pair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve.serve_loopback, driver, driver_end)
        try:
            async with _handshaken(host_end, spec, f"{spec.module_name} (loopback)") as link:
                yield link
        finally:
            tg.cancel_scope.cancel()


def build_driver(module_name: str, args: Sequence[str]) -> Any:
    """The driver object `python -m MODULE ARGS` would serve, built in this process by the
    package's `create_driver(argv)` (imported by name: the host never imports drivers)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DriverFailed(f"cannot import driver module {module_name!r}: {exc}") from None
    create = getattr(module, "create_driver", None)
    if create is None:
        raise DriverFailed(f"driver module {module_name!r} has no create_driver(argv) for loopback")
    try:
        return create(list(args))
    except SystemExit as exc:
        raise DriverFailed(f"driver {module_name} rejected its options {list(args)} (exit {exc.code})") from None
