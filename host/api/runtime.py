"""`wafer:inferlet/runtime`: the run's arguments, output stream, messages and log."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from wasmtime.component import LinkerInstance

from host.api.host_call import host_function
from host.sandbox.run_io import RunIO, utf8_len
from host.sandbox.run_state import RunState

INTERFACE = "runtime"
_POLL_S = 0.1
# What one run may write to the host's log through `log` (UTF-8 bytes): the host keeps its log
# on disk or a terminal, outside any run's budget (a loop of `log` wrote 1 GiB in 2.9 s). Past
# it lines are dropped, and one line says so.


@dataclass(slots=True)
class _LogBudget:
    num_bytes: int = 0  # logged so far
    is_cut: bool = False  # lines were dropped (and the host's log said so)


# Keyed by the run's conversation (one per run; RunState cannot be weakly referenced).
_log_budgets: weakref.WeakKeyDictionary[RunIO, _LogBudget] = weakref.WeakKeyDictionary()
_log_budgets_lock = threading.Lock()


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
    with _log_budgets_lock:
        budget = _log_budgets.setdefault(run.io, _LogBudget())
    size = utf8_len(message)
    limit = run.config.host_limits.log_bytes
    if budget.num_bytes + size <= limit:
        budget.num_bytes += size
        run.io.log(run.run_id, level, message)
    elif not budget.is_cut:
        budget.is_cut = True
        run.io.log(
            run.run_id,
            "warning",
            f"log limit reached: the run logged {budget.num_bytes} bytes, and a run may log {limit}; "
            "its later lines are dropped",
        )


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
