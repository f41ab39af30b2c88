"""The run's arguments and its conversation with the client."""

from __future__ import annotations

from wit_world.imports import runtime as _rt

from inferlet.checks import need


def args() -> list[str]:
    """The arguments the client passed (after `--` on the `wafer run` command line)."""
    return list(_rt.args())


def run_id() -> int:
    """This run's id, as the host's logs show it."""
    return _rt.run_id()


def emit(text: str) -> None:
    """Append `text` to the run's output stream (printed by `wafer run` as it arrives)."""
    need(text, str, "emit()'s text")
    if text:
        _rt.emit(text)


def send(message: str) -> None:
    """Send one message to the client, on a channel separate from the output stream (a str:
    `json.dumps` a structure first)."""
    need(message, str, "send()'s message")
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
    need(message, str, "log()'s message")
    if level not in _LEVELS:
        raise ValueError(f"log()'s level must be one of {', '.join(_LEVELS)}, not {level!r}")
    _rt.log(_LEVELS[level], message)
