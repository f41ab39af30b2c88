"""The grammar compile helper (`python -m host.grammar.compile_zygote FD`): imports the engines
once, keeps a GrammarBuilder per tokenizer, and forks a child per compile (it is single-threaded,
so forking is safe), which reads its request from a socket of its own, answers on it and exits.
Its control socket's end (the host's exit) ends it and its children.

Started and fed by host.grammar.compile_process; knows the builder, not budgets or caching.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from host.grammar.compile_process import BY_REASON, CONTROL_BYTES, HEADER_END, read_to_end
from host.grammar.errors import CompileFailed, GrammarTooLarge, InvalidGrammar, TokenizerUnsupported, UnsupportedSchema

if TYPE_CHECKING:
    from host.grammar.builder import GrammarBuilder
    from host.grammar.grammar import GrammarKey

_REAP_EVERY_S = 0.2


def _error_header(exc: BaseException, kind: str) -> dict[str, Any]:
    if isinstance(exc, UnsupportedSchema):
        return {"error": "UnsupportedSchema", "features": list(exc.features), "refusal": exc.refusal}
    if isinstance(exc, GrammarTooLarge):
        return {"error": "GrammarTooLarge", "kind": exc.kind, "size": exc.size_bytes, "budget": exc.budget_bytes}
    if isinstance(exc, InvalidGrammar):
        name = type(exc).__name__ if type(exc).__name__ in BY_REASON else "InvalidGrammar"
        return {"error": name, "kind": exc.kind, "reason": exc.reason}
    if isinstance(exc, TokenizerUnsupported):
        return {"error": "TokenizerUnsupported", "reason": str(exc)}
    return {"error": "CompileFailed", "kind": kind, "reason": f"{type(exc).__name__}: {exc}"}


def _answer(builder: GrammarBuilder | None, key: GrammarKey, max_bytes: int) -> bytes:
    """What a child says for `key`: a header line, then what the host rebuilds the grammar from
    (GrammarBuilder.portable; nothing when the host compiles it again)."""
    try:
        if builder is None:
            raise CompileFailed(key.kind, "the compile helper has no token table for this tokenizer")
        grammar = builder.build(key)
        if grammar.memory_bytes > max_bytes:
            raise GrammarTooLarge(key.kind, grammar.memory_bytes, max_bytes)
        payload = builder.portable(grammar)
    except Exception as exc:  # every failure is an answer the host turns back into its error
        return json.dumps(_error_header(exc, key.kind)).encode() + HEADER_END
    header = {"backend": grammar.backend, "unsupported": list(grammar.unsupported), "time_s": grammar.compile_time_s}
    return json.dumps(header).encode() + HEADER_END + (payload or "").encode("utf-8")


def _child(job: socket.socket, builder: GrammarBuilder | None) -> None:
    key, max_bytes = pickle.loads(read_to_end(job, None))
    job.sendall(_answer(builder, key, max_bytes))


def _zygote(control: socket.socket) -> None:
    from host.grammar import schema_support
    from host.grammar.builder import GrammarBuilder

    schema_support.checked_formats({})  # jsonschema and its format checkers, once, before any fork
    builders: dict[int, GrammarBuilder] = {}
    children: dict[int, int] = {}  # job id -> pid, while not reaped
    try:
        control.send(b"ready")
    except OSError:
        return  # the host ended (or gave up on us) while we were importing
    while True:
        readable, _, _ = select.select([control], [], [], _REAP_EVERY_S)
        _reap(children)
        if not readable:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(control, CONTROL_BYTES, 1)
        except OSError:
            data, fds = b"", []
        if not data:  # the host is gone or closed us: so are its compiles
            for pid in children.values():
                _signal(pid, signal.SIGKILL)
            return
        message = pickle.loads(data)
        if message[0] == "builder":
            with socket.socket(fileno=fds[0]) as payload:
                spec = pickle.loads(read_to_end(payload, None))
                try:
                    builders[message[1]] = _warmed(GrammarBuilder(spec, max_threads=message[2]))
                    payload.sendall(b"built")
                except Exception as exc:  # the host goes on compiling in its own process
                    payload.sendall(f"no builder: {exc}".encode())
        elif message[0] == "compile":
            children[message[1]] = _fork_child(control, fds[0], builders.get(message[2]))
        elif message[0] == "kill" and message[1] in children:
            _signal(children[message[1]], signal.SIGKILL)


def _warmed(builder: GrammarBuilder) -> GrammarBuilder:
    """`builder`, with what both engines build on first use built here, once, before any fork
    (llguidance's token table alone takes 0.1-0.5 s)."""
    from host.grammar.grammar import GrammarKey
    from host.grammar.options import option_items

    for kind, text in (("json", ""), ("json_schema", '{"type":"string","maxLength":64}')):
        builder.build(GrammarKey(kind, text, option_items(kind, {})))
    return builder


def _fork_child(control: socket.socket, fd: int, builder: GrammarBuilder | None) -> int:
    pid = os.fork()
    if pid == 0:  # the child: answer, and never return into the zygote's loop
        status = 0
        try:
            control.close()
            with socket.socket(fileno=fd) as job:
                _child(job, builder)
        except BaseException:  # the child ends here, whatever happened
            status = 1
        finally:
            os._exit(status)
    os.close(fd)
    return pid


def _reap(children: dict[int, int]) -> None:
    for job_id, pid in list(children.items()):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            del children[job_id]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host ends us by closing the control socket
    _zygote(socket.socket(fileno=int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
