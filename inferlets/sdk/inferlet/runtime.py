"""The run's arguments and its conversation with the client."""

from __future__ import annotations

from wit_world.imports import runtime as _rt


def args() -> list[str]:
    """The arguments the client passed (after `--` on the `wafer run` command line)."""
    return list(_rt.args())


def run_id() -> int:
    """This run's id, as the host's logs show it."""
    return _rt.run_id()


def emit(text: str) -> None:
    """Append `text` to the run's output stream (printed by `wafer run` as it arrives)."""
    if text:
        _rt.emit(text)


def send(message: str) -> None:
    """Send one message to the client, on a channel separate from the output stream."""
    _rt.send(message)


def receive() -> str | None:
    """Block until the client sends a message; None once the client has closed its side."""
    return _rt.receive()


_LEVELS = {
    "debug": _rt.LogLevel.DEBUG,
    "info": _rt.LogLevel.INFO,
    "warning": _rt.LogLevel.WARNING,
    "error": _rt.LogLevel.ERROR,
}


def log(message: str, level: str = "info") -> None:
    """Write a line to the host's log, tagged with this run's id. `level`: debug, info,
    warning or error."""
    _rt.log(_LEVELS[level], message)
