"""Driver supervision: killing the driver mid-generation fails the affected requests promptly with
a clear error, /health reports it, the driver is restarted, and the next request succeeds."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import openai
import pytest

from tests.host.daemon.conftest import Server

MESSAGES: Any = [{"role": "user", "content": "Tell a long story."}]


def _driver_pid(server: Server) -> int:
    health = server.wait_ready()
    driver = health["driver"]
    assert isinstance(driver, dict)
    pid = driver["pid"]
    assert isinstance(pid, int)
    return pid


def test_driver_killed_mid_stream(server: Server) -> None:
    pid = _driver_pid(server)
    with server.http() as http:
        restarts_before = http.get("/health").json()["driver"]["restarts"]
    client = server.client()
    # A non-streamed request in flight at the same time.
    outcome: dict[str, BaseException | object] = {}

    def non_streamed() -> None:
        try:
            outcome["result"] = client.chat.completions.create(
                model="dummy", messages=MESSAGES, max_tokens=400, extra_body={"ignore_eos": True}
            )
        except BaseException as exc:  # recorded for the assertion below
            outcome["error"] = exc

    # ignore_eos: no stop token ends either generation before the kill (the dummy samples one in
    # about every 130 tokens).
    stream = client.chat.completions.create(
        model="dummy", messages=MESSAGES, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    thread = threading.Thread(target=non_streamed)
    thread.start()
    is_killed = False
    with pytest.raises(openai.APIError) as info:
        for _chunk in stream:
            # Kill only once both requests are generating (a run that has generated nothing yet
            # would be started again on the new driver, and succeed).
            if not is_killed and _num_generating(server) == 2:
                os.kill(pid, signal.SIGKILL)
                is_killed = True
    assert "driver" in str(info.value.message)
    thread.join()
    error = outcome.get("error")
    assert isinstance(error, openai.APIStatusError), outcome
    assert error.status_code == 503 and "driver" in error.message

    # The driver comes back; the next request succeeds.
    response = client.chat.completions.create(model="dummy", messages=MESSAGES, max_tokens=5)
    assert response.choices[0].finish_reason in ("stop", "length")
    health = server.wait_ready()
    driver = health["driver"]
    assert isinstance(driver, dict)
    assert driver["restarts"] > restarts_before
    assert driver["pid"] != pid
    assert "exited" in str(driver["last_error"]) or driver["last_error"] is None


def _num_generating(server: Server) -> int:
    assert server.daemon is not None
    running = [r for r in server.daemon.runs.list("chat") if r.outcome is None]
    return sum(
        any(e.kind == "output" or (e.kind == "message" and "deltas" in e.data) for e in r.log.snapshot())
        for r in running
    )


def _wait_dead(pid: int) -> None:
    """Until the process has exited (a zombie or reaped): SIGKILL is delivered asynchronously."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):  # reaped between the open and the read
            return
        time.sleep(0.01)


def test_driver_killed_while_idle(server: Server) -> None:
    pid = _driver_pid(server)
    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)
    # Whether the request lands before or after the restart, it waits for the new driver.
    response = server.client().chat.completions.create(model="dummy", messages=MESSAGES, max_tokens=5)
    assert response.choices
    assert _driver_pid(server) != pid
