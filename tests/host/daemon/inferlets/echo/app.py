"""A test inferlet for the daemon's run endpoints. args[0] picks the behaviour:
`echo`: emit each received message back, then send a summary once the client closes;
`decode`: decode forever (until cancelled), emitting each token; `flood`: emit 1 MiB chunks
forever (the run's output limit ends it)."""

import json

from inferlet import Context, emit, receive, send


def main(args: list[str]) -> None:
    mode = args[0] if args else "echo"
    if mode == "echo":
        count = 0
        while (message := receive()) is not None:
            emit(f"echo: {message}\n")
            count += 1
        send(json.dumps({"received": count}))
    elif mode == "decode":
        with Context() as ctx:
            ctx.fill("forever")
            while True:
                ctx.decode_step()
                emit(".")
    elif mode == "flood":
        chunk = "x" * (1 << 20)
        while True:
            emit(chunk)
    else:
        raise ValueError(f"unknown mode {mode!r}")
