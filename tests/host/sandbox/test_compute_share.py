"""Guest compute shared out by group: at most `slots` runs of a group compute at once, waiting
runs are served first come first served, a run that yields goes to the back of the line, and a
run stopped while waiting holds nothing. Then through the sandbox: two spinning runs of one key
take turns on one slot while another key's run never waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from host.build import build
from host.sandbox import RunStatus, Sandbox
from host.sandbox.compute_share import ComputeShare
from host.sandbox.config import SandboxConfig
from tests.host.sandbox.table_services import TableServices


def _never_stop() -> None:
    return None


def _enter_in_thread(share: ComputeShare, group: str, order: list[str], name: str) -> threading.Thread:
    def enter() -> None:
        share.enter(group, _never_stop)
        order.append(name)

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    return thread


def _wait_until(condition: object, timeout_s: float = 10.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_group_computes_on_its_slots_and_waiters_go_in_order() -> None:
    share = ComputeShare(slots=1)
    order: list[str] = []
    share.enter("a", _never_stop)
    share.enter("b", _never_stop)  # another group: its own slot
    first = _enter_in_thread(share, "a", order, "first")
    _wait_until(lambda: share.num_waiting("a") == 1)
    second = _enter_in_thread(share, "a", order, "second")
    _wait_until(lambda: share.num_waiting("a") == 2)
    assert order == [] and share.num_busy("a") == 1
    share.leave("a")
    first.join(5)
    assert order == ["first"] and share.num_waiting("a") == 1
    share.leave("a")
    second.join(5)
    assert order == ["first", "second"]
    share.leave("a")
    share.leave("b")
    assert share.num_busy("a") == share.num_busy("b") == 0


def test_a_run_stopped_while_waiting_holds_no_slot() -> None:
    share = ComputeShare(slots=1)
    share.enter("a", _never_stop)
    stop = threading.Event()
    caught: list[BaseException] = []

    def may_continue() -> None:
        if stop.is_set():
            raise RuntimeError("cancelled")

    def enter() -> None:
        try:
            share.enter("a", may_continue)
        except RuntimeError as exc:
            caught.append(exc)

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    _wait_until(lambda: share.num_waiting("a") == 1)
    stop.set()
    thread.join(5)
    assert caught and share.num_waiting("a") == 0
    share.leave("a")
    assert share.num_busy("a") == 0
    share.enter("a", _never_stop)  # the slot is free again


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ComputeShare(0)


def test_runs_of_one_key_take_turns_and_another_key_never_waits(cache_dir: Path, services: TableServices) -> None:
    """Two runs of key "a" spin (no host calls) on one slot: one of them always waits, and they
    alternate at the watchdog's checks; a run of key "b" meanwhile takes its own slot."""
    config = SandboxConfig(cache_dir=cache_dir, inactivity_timeout_s=1.5, group_compute_slots=1)
    with Sandbox(config) as sandbox:  # its own engine: the component is loaded for it
        misbehave = sandbox.load(build(str(Path(__file__).parent / "inferlets" / "misbehave"), cache_dir).wasm_path)
        share = sandbox.compute
        assert share is not None
        spinners = [sandbox.start(misbehave, services, ["spin"], group="a") for _ in range(2)]
        _wait_until(lambda: share.num_waiting("a") == 1)  # one spins, one waits
        turns = []  # which spinner holds the slot, as it changes
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            holder = tuple(h._run.state.is_in_guest for h in spinners)
            if holder.count(True) == 1 and (not turns or turns[-1] != holder):
                turns.append(holder)
            time.sleep(0.005)
        assert len(turns) >= 3, turns  # they alternate at the 0.2 s checks
        seen_waiting = {share.num_waiting("b")}
        other = sandbox.start(misbehave, services, ["decode", "3"], group="b")
        outcome = other.wait(timeout_s=60)
        seen_waiting.add(share.num_waiting("b"))
        assert outcome.status is RunStatus.OK, outcome.error
        assert seen_waiting == {0}
        for handle in spinners:  # each got turns: both reach the watchdog, neither starved
            done = handle.wait(timeout_s=60)
            assert done.status is RunStatus.TIMED_OUT and "watchdog" in (done.error or ""), done.error
        assert share.num_busy("a") == 0 and share.num_waiting("a") == 0


def test_host_work_is_paced_while_runs_of_other_groups_are_live(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host call's CPU time is waited again for each other group with a live run (a key's
    group of a thousand passes costs it, not the others); alone, or for a cheap call, no wait."""
    from host.sandbox.run_state import RunState

    slept: list[float] = []
    monkeypatch.setattr("host.sandbox.run_state.time.sleep", slept.append)
    share = ComputeShare(1)
    config = SandboxConfig(cache_dir=Path("unused"))
    run = RunState(1, [], TableServices(), None, config, 0.0, group="a", compute=share)  # type: ignore[arg-type]
    share.join("a")
    run.pace(0.05)
    assert slept == []  # its group alone
    share.join("b")
    share.join("b")
    run.pace(0.05)
    share.join("c")
    run.pace(0.05)
    run.pace(0.001)  # too cheap to pace
    run.pace(10.0)  # at most the cap
    assert slept == [0.05, 0.1, 0.5]
    for group in ("b", "b", "c"):
        share.quit(group)
    run.pace(0.05)
    assert slept == [0.05, 0.1, 0.5] and share.num_other_groups("a") == 0
