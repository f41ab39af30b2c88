"""hello: the smallest inferlet. Greets, then writes a few tokens after a prompt."""

from inferlet import Context, emit, model_info


def main(args: list[str]) -> None:
    name = args[0] if args else "world"
    emit(f"Hello, {name}! This is {model_info().name}.\n")
    with Context() as ctx:
        ctx.fill("Once upon a time")
        for piece in ctx.generate_text(max_tokens=8):
            emit(piece)
    emit("\n")
