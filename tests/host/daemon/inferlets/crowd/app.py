"""A test inferlet that crowds the engine: args `N` creates N contexts of one token each and
decodes a step on all of them together, forever (until cancelled)."""

from inferlet import Context, decode_steps, emit


def main(args: list[str]) -> None:
    contexts: list[Context] = []
    for i in range(int(args[0])):
        ctx = Context()
        ctx.fill([1 + i % 200])
        contexts.append(ctx)
    emit(f"{len(contexts)} contexts\n")
    while True:
        decode_steps(contexts)
        emit(".")
