"""`wafer:inferlet/runtime`: the run's arguments, output stream, messages and log."""

from __future__ import annotations

from wasmtime.component import LinkerInstance

from host.api.host_call import host_function
from host.sandbox.run_state import RunState

INTERFACE = "runtime"
_POLL_S = 0.1


@host_function
def args(run: RunState) -> list[str]:
    return list(run.args)


@host_function
def run_id(run: RunState) -> int:
    return run.run_id


@host_function
def emit(run: RunState, chunk: str) -> None:
    run.emit(chunk)


@host_function
def send(run: RunState, message: str) -> None:
    run.charge_output(message)
    run.io.send(message)


@host_function
def receive(run: RunState) -> str | None:
    # Blocking host calls are not interrupted by the epoch watchdog: wait in short slices so
    # that cancellation and the wall-clock budget still stop the run.
    while True:
        run.check_can_continue()
        try:
            return run.io.receive(timeout_s=min(_POLL_S, max(run.remaining_s(), 0.001)))
        except TimeoutError:
            continue


@host_function
def log(run: RunState, level: str, message: str) -> None:
    run.io.log(run.run_id, level, message)


@host_function
def app_sources(run: RunState) -> list[tuple[str, str]]:
    return list(run.app_files)


def register(instance: LinkerInstance) -> None:
    instance.add_func("args", args)
    instance.add_func("run-id", run_id)
    instance.add_func("emit", emit)
    instance.add_func("send", send)
    instance.add_func("receive", receive)
    instance.add_func("log", log)
    instance.add_func("app-sources", app_sources)
