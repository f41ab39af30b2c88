"""Grammar compiles in child processes, so that one past its budget is killed and its worker freed
(a compile inside xgrammar cannot be interrupted, and one schema can keep it busy for a minute).

The host's side: it starts the helper process (host.grammar.compile_zygote), hands it a token
table per tokenizer and then compiles, each answered by a child forked for it on a socket of its
own, and kills a child past its deadline. Knows the wire; not caching, owners or the budget's
policy.
"""

from __future__ import annotations

import atexit
import json
import logging
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from host.grammar.errors import (
    CompileBudgetExceeded,
    CompileFailed,
    GrammarError,
    GrammarTooLarge,
    InvalidEBNF,
    InvalidGrammar,
    InvalidJSONSchema,
    InvalidRegex,
    InvalidToolCall,
    TokenizerUnsupported,
    UnsupportedSchema,
)

if TYPE_CHECKING:
    from host.grammar.grammar import GrammarKey
    from host.grammar.tokenizer_info import CacheKey, TokenizerSpec

_log = logging.getLogger("wafer.grammar")

# Importing xgrammar (and torch) and jsonschema's format checkers takes the zygote 3-6 s on an
# idle machine, and about 20 s on two cores that other processes keep busy.
START_TIMEOUT_S = 120.0
CONTROL_BYTES = 4096  # one control message (a pickled tuple of a few small values)
# What a child answers with before its payload: one line of JSON.
HEADER_END = b"\n"


@dataclass(frozen=True, slots=True)
class Compiled:
    """A child's answer: the engine that compiled it, what the host rebuilds it from ("" when
    the host compiles it again: GrammarBuilder.portable), what it left unenforced and how long
    the compile took."""

    backend: str
    payload: str
    unsupported: tuple[str, ...]
    compile_time_s: float


class CompileProcesses:
    """The host's side: starts the zygote, hands it compiles, kills those past their deadline.
    Thread-safe; one per host process (`shared`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._ready = threading.Event()
        # The running zygote's builders, by (tokenizer, xgrammar threads): their ids once built,
        # and those it is building.
        self._builders: dict[tuple[CacheKey, int], int] = {}
        self._preparing: set[tuple[CacheKey, int]] = set()
        self._next_id = 1
        self._generation = 0  # which zygote: a builder registered with an earlier one is not kept

    def start(self) -> None:
        """Start the zygote in the background unless it runs or is starting; `is_ready` says
        when it takes compiles."""
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                return
            self._ready.clear()
            self._builders.clear()
            self._preparing.clear()
            self._generation += 1
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "host.grammar.compile_zygote", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,  # a terminal's Ctrl-C is the host's to handle
                )
            except OSError as exc:
                ours.close()
                _log.warning("grammar compiles stay in this process: the compile helper did not start: %s", exc)
                return
            finally:
                theirs.close()
            self._control = ours
        threading.Thread(target=self._await_ready, args=(ours,), name="grammar-zygote-start", daemon=True).start()

    def _await_ready(self, control: socket.socket) -> None:
        control.settimeout(START_TIMEOUT_S)
        try:
            ready = control.recv(CONTROL_BYTES) == b"ready"
        except OSError:
            ready = False
        if ready:
            self._ready.set()
        elif self._control is control:  # (not closed on purpose)
            _log.warning("grammar compiles stay in this process: the compile helper did not get ready")

    def prepare(self, spec: TokenizerSpec, max_threads: int) -> None:
        """Have the zygote (started if need be) build its GrammarBuilder for `spec` in the
        background (a second or so for a real tokenizer); `is_ready_for` says when it has."""
        self.start()
        key = (spec.cache_key, max_threads)
        with self._lock:
            if key in self._builders or key in self._preparing:
                return
            self._preparing.add(key)
        threading.Thread(
            target=self._register, args=(spec, max_threads), name="grammar-zygote-builder", daemon=True
        ).start()

    @property
    def helper_pid(self) -> int | None:
        """The zygote's process id, while it runs (its children are the compiles under way)."""
        with self._lock:
            return self._process.pid if self._process is not None and self._process.poll() is None else None

    def is_ready_for(self, spec: TokenizerSpec, max_threads: int) -> bool:
        with self._lock:
            return self._ready.is_set() and (spec.cache_key, max_threads) in self._builders

    def wait_ready_for(self, spec: TokenizerSpec, max_threads: int, timeout_s: float) -> bool:
        """Prepare and wait until compiles for `spec` go to child processes (tests, benchmarks)."""
        self.prepare(spec, max_threads)
        deadline_s = time.monotonic() + timeout_s
        while not self.is_ready_for(spec, max_threads):
            if time.monotonic() > deadline_s:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        """Stop the zygote (it kills its children); a later `start` starts another."""
        with self._lock:
            control, process, self._control, self._process = self._control, self._process, None, None
            was_ready = self._ready.is_set()
            self._ready.clear()
        if control is not None:
            control.close()  # a ready zygote ends at the end of its control socket, with its children
        if process is not None:
            try:
                process.wait(1 if was_ready else 0)  # (one still importing has no children yet)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def compile(
        self, builder_key: tuple[TokenizerSpec, int], key: GrammarKey, max_bytes: int, deadline_s: float | None
    ) -> Compiled:
        """Compile `key` for (tokenizer, xgrammar threads) in a child; past `deadline_s`
        (time.monotonic) the child is killed and CompileBudgetExceeded raised (its budget_s is
        0: the caller knows its own). Raises the child's GrammarError, CompileFailed when it
        died, and OSError when the zygote is gone (then the caller compiles elsewhere)."""
        with self._lock:
            builder_id = self._builders.get((builder_key[0].cache_key, builder_key[1]))
        if builder_id is None:
            raise OSError("the grammar compile helper has no builder for this tokenizer yet")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours:
            with self._lock:
                job_id, self._next_id = self._next_id, self._next_id + 1
            try:
                self._send(("compile", job_id, builder_id), theirs)
            finally:
                theirs.close()
            try:
                _send_all(ours, pickle.dumps((key, max_bytes)), deadline_s)
                ours.shutdown(socket.SHUT_WR)
                answer = read_to_end(ours, deadline_s)
            except TimeoutError:
                self._kill(job_id)
                raise CompileBudgetExceeded(key.kind, 0.0) from None
        return _decode(key.kind, answer)

    def _register(self, spec: TokenizerSpec, max_threads: int) -> None:
        """Send `spec` to the zygote once it is ready, and wait until its builder is built."""
        key = (spec.cache_key, max_threads)
        built = False
        try:
            if not self._ready.wait(START_TIMEOUT_S):
                return
            with self._lock:
                builder_id, self._next_id = self._next_id, self._next_id + 1
                generation = self._generation
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with ours:
                try:
                    self._send(("builder", builder_id, max_threads), theirs)
                finally:
                    theirs.close()
                ours.sendall(pickle.dumps(spec))
                ours.shutdown(socket.SHUT_WR)
                built = read_to_end(ours, time.monotonic() + START_TIMEOUT_S) == b"built"
        except OSError as exc:
            _log.warning("grammar compiles stay in this process for now: %s", exc)
        finally:
            with self._lock:
                self._preparing.discard(key)
                if built and generation == self._generation:
                    self._builders[key] = builder_id

    def _send(self, message: tuple[Any, ...], fd_owner: socket.socket | None = None) -> None:
        with self._lock:
            control = self._control
            if control is None or not self._ready.is_set():
                raise OSError("the grammar compile helper is not running")
            try:
                fds = [fd_owner.fileno()] if fd_owner is not None else []
                socket.send_fds(control, [pickle.dumps(message)], fds)
            except OSError:
                self._ready.clear()  # gone: the caller compiles elsewhere, and the next start replaces it
                self._control = None
                control.close()
                if self._process is not None:
                    self._process.kill()
                raise

    def _kill(self, job_id: int) -> None:
        try:
            self._send(("kill", job_id))
        except OSError:
            pass  # the zygote is gone, and it took its children with it


def _set_deadline(sock: socket.socket, deadline_s: float | None) -> None:
    """TimeoutError when `deadline_s` (time.monotonic) has passed, else the socket's timeout."""
    if deadline_s is not None:
        left = deadline_s - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)


def _send_all(sock: socket.socket, data: bytes, deadline_s: float | None) -> None:
    view = memoryview(data)
    while view:
        _set_deadline(sock, deadline_s)
        view = view[sock.send(view) :]


def read_to_end(sock: socket.socket, deadline_s: float | None) -> bytes:
    """Everything until the peer closes; TimeoutError past `deadline_s` (time.monotonic)."""
    chunks: list[bytes] = []
    while True:
        _set_deadline(sock, deadline_s)
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            raise
        except OSError:
            chunk = b""  # the child died mid-answer: what came is decoded (and found short)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


_shared: CompileProcesses | None = None
_shared_lock = threading.Lock()


def shared() -> CompileProcesses:
    """This process's compile helper (started by the first GrammarCompiler that asks)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CompileProcesses()
            atexit.register(_shared.close)  # its end is seen in a fraction of a second
        return _shared


# ------------------------------------------------------------------ errors across the wire

# Errors whose constructor takes the reason alone (the kind is theirs).
BY_REASON: dict[str, Callable[[str], InvalidGrammar]] = {
    cls.__name__: cls for cls in (InvalidJSONSchema, InvalidRegex, InvalidEBNF, InvalidToolCall)
}


def _error_from(header: dict[str, Any]) -> GrammarError:
    name = header["error"]
    if name == "UnsupportedSchema":
        return UnsupportedSchema(tuple(header["features"]), header["refusal"])
    if name == "GrammarTooLarge":
        return GrammarTooLarge(header["kind"], header["size"], header["budget"])
    if name in BY_REASON:
        return BY_REASON[name](header["reason"])
    if name == "InvalidGrammar":
        return InvalidGrammar(header["kind"], header["reason"])
    if name == "TokenizerUnsupported":
        return TokenizerUnsupported(header["reason"])
    return CompileFailed(header.get("kind", "?"), header.get("reason", "no reason given"))


def _decode(kind: str, answer: bytes) -> Compiled:
    head, sep, payload = answer.partition(HEADER_END)
    if not sep:
        raise CompileFailed(kind, "the compile process ended without an answer (out of memory, or a crash)")
    header = json.loads(head)
    if "error" in header:
        raise _error_from(header)
    return Compiled(header["backend"], payload.decode("utf-8"), tuple(header["unsupported"]), header["time_s"])
