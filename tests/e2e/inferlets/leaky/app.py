"""A test inferlet for the harness's page counts: fills `args[0]` contexts with `args[1]` tokens
each, keeps them (in a module global, so not even garbage collection releases them) and ends;
with args[2] == "release" it releases them first."""

from inferlet import Context, emit

KEPT: list = []


def main(args: list[str]) -> None:
    count, length = int(args[0]), int(args[1])
    contexts = KEPT
    for _ in range(count):
        ctx = Context()
        ctx.fill("x" * length)
        ctx.decode_step()  # runs the fill: its pages are taken
        contexts.append(ctx)
    if len(args) > 2 and args[2] == "release":
        for ctx in contexts:
            ctx.release()
    emit(f"held {count}")
