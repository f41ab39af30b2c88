"""A test inferlet for what a context can see of its own limits: its KV pages, the run's pages
in use, the room left before the model's context length, and the error past it."""

import json

from inferlet import Context, InferenceError, emit, pages_in_use, send


def main(args: list[str]) -> None:
    ctx = Context()
    ctx.fill([65] * int(args[0]))
    ctx.flush()  # all but the last token in the KV
    child = ctx.fork()
    report = {"pages": ctx.num_pages, "child_pages": child.num_pages, "in_use": pages_in_use(), "room": ctx.room}
    child.release()
    generated = list(ctx.generate(10_000, stop=[]))  # ends at the context length
    report["generated"] = len(generated)
    report["room_after"] = ctx.room
    try:
        ctx.decode_step()
    except InferenceError as exc:
        emit(str(exc))
    send(json.dumps(report))
