"""How the daemon reads a chat run's events: output chunks that arrived together become one
delta of choice 0, in order with the run's messages; a follower that falls behind gets what it
missed in one batch; one loop wake-up covers a burst of events."""

from __future__ import annotations

import asyncio
import json
import threading

from host.daemon.openai_routes import _batch_updates
from host.daemon.run_log import RunEvent, RunLog


def _events(*specs: tuple[str, object]) -> list[RunEvent]:
    return [RunEvent(i, kind, data) for i, (kind, data) in enumerate(specs)]


def test_output_chunks_together_become_one_delta_in_order_with_messages() -> None:
    batch = _events(
        ("message", json.dumps({"prompt_tokens": [3]})),
        ("output", "Hel"),
        ("output", "lo"),
        ("message", json.dumps({"deltas": [[0, "!", None]], "finished": [[0, "stop", 4]]})),
        ("end", {}),
    )
    assert _batch_updates(batch) == [
        {"prompt_tokens": [3]},
        {"deltas": [[0, "Hello", None]]},
        {"deltas": [[0, "!", None]], "finished": [[0, "stop", 4]]},
    ]
    assert _batch_updates(_events(("output", "a"))) == [{"deltas": [[0, "a", None]]}]


def test_a_follower_gets_a_burst_in_one_batch_with_one_wake_up() -> None:
    async def scenario() -> tuple[list[list[str]], int]:
        loop = asyncio.get_running_loop()
        log = RunLog("run 1", loop)
        wakeups = 0
        notify = log._notify

        def counted() -> None:
            nonlocal wakeups
            wakeups += 1
            notify()

        log._notify = counted  # type: ignore[method-assign]
        # A burst from the run's thread while the loop is busy (blocked here, joining the thread):
        # one wake-up is queued for all three.
        burst = threading.Thread(target=lambda: [log.emit(piece) for piece in ("a", "b", "c")])
        burst.start()
        burst.join()
        batches: list[list[str]] = []

        async def follow() -> None:
            async for batch in log.follow_batches():
                batches.append([e.kind for e in batch])

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        await asyncio.to_thread(log.end, {"status": "ok"})
        await asyncio.wait_for(task, 5)
        return batches, wakeups

    batches, wakeups = asyncio.run(scenario())
    assert batches == [["output", "output", "output"], ["end"]]
    assert wakeups == 2  # one for the burst, one for the end
