"""How the daemon reads a chat run's events: output chunks that arrived together become one
delta of choice 0, in order with the run's messages; a follower that falls behind gets what it
missed in one batch; one loop wake-up covers a burst of events; a stream sends what one batch
produced as one body message."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

from host.daemon.http_util import SSE_DONE, sse
from host.daemon.metrics import Registry
from host.daemon.openai_prepare import Job
from host.daemon.openai_render import Renderer
from host.daemon.openai_routes import OpenAIWire, _batch_updates, _stream, _TokenClock
from host.daemon.run_log import RunEvent, RunLog
from host.sandbox import RunOutcome, RunStatus
from host.tokenizer import BytesTokenizer


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
    assert _batch_updates(batch) == (
        [
            {"prompt_tokens": [3]},
            {"deltas": [[0, "Hello", None]]},
            {"deltas": [[0, "!", None]], "finished": [[0, "stop", 4]]},
        ],
        3,  # generated pieces: "Hel", "lo", "!" (for the inter-token latency)
    )
    assert _batch_updates(_events(("output", "a"))) == ([{"deltas": [[0, "a", None]]}], 1)


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


def _renderer(kind: str) -> Renderer:
    job = Job({}, num_prompts=1, n=1, prompt_tokens=3, logprobs=False, top_logprobs=0, stream=True, include_usage=True)
    renderer = Renderer(kind, job, "dummy", BytesTokenizer(256), "req_1")
    renderer.created = 1700000000
    return renderer


def _stream_bodies(kind: str) -> list[bytes]:
    """The body messages of a finished run's stream: the events up to its first output were read
    before the stream began (as `_start` does); the rest arrive as one batch."""

    async def scenario() -> list[bytes]:
        log = RunLog("run 1", asyncio.get_running_loop())
        log.send(json.dumps({"prompt_tokens": [3]}))
        log.emit("Hel")
        for piece in ("lo", ' "wor', "ld\n"):
            log.emit(piece)
        log.send(json.dumps({"finished": [[0, "length", 5]]}))
        log.end({"state": "succeeded"})
        events = log.snapshot()
        record: Any = SimpleNamespace(
            log=log, done=threading.Event(), outcome=RunOutcome(1, RunStatus.OK, ""), run_id=1, driver_lost=""
        )
        record.done.set()
        m = Registry()
        daemon: Any = SimpleNamespace(
            inter_token=m.histogram("itl", "", ("endpoint",)),
            e2e=m.histogram("e2e", "", ("endpoint",)),
            requests=m.counter("requests", "", ("endpoint", "outcome")),
            prompt_tokens=m.counter("prompt", "", ("endpoint",)),
            generation_tokens=m.counter("generation", "", ("endpoint",)),
        )
        clock = _TokenClock(daemon, kind)
        stream = _stream(daemon, kind, record, _renderer(kind), OpenAIWire(), 0.0, events[:2], clock)
        return [body async for body in stream]

    return asyncio.run(scenario())


def test_a_stream_sends_one_body_message_per_batch_with_every_chunk_in_order() -> None:
    for kind in ("chat", "completion"):
        bodies = _stream_bodies(kind)
        # The opening chunk and the first output; the rest of the output and the finish; the end.
        assert len(bodies) == 3
        renderer = _renderer(kind)
        expected = [sse(chunk) for chunk in renderer.first_chunks()]
        for update in (
            {"prompt_tokens": [3]},
            {"deltas": [[0, "Hel", None]]},
            {"deltas": [[0, 'lo "world\n', None]]},
            {"finished": [[0, "length", 5]]},
        ):
            expected += [sse(chunk) for chunk in renderer.update_chunks(renderer.apply(update))]
        expected += [sse(renderer.usage_chunk()), SSE_DONE]
        assert b"".join(bodies) == b"".join(expected)
