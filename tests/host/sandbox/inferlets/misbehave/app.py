"""A test inferlet that misbehaves on request: args[0] names the behaviour."""

import json
import os
import sys
import time

from inferlet import Adapter, AdapterError, Context, emit, model_info, receive, run_id, send

try:
    import socket
except ImportError:  # componentize-py's CPython is built without it
    socket = None

_kept: list = []


def spin(args):
    n = 0
    while True:
        n += 1


def bursts(args):
    """args[1] bursts of args[2] seconds of computing, each followed by one host call."""
    count, seconds = int(args[1]), float(args[2])
    for _ in range(count):
        start = time.monotonic()
        while time.monotonic() - start < seconds:  # clock reads are not host calls
            pass
        run_id()
    emit(f"{count} bursts")


def alloc(args):
    while True:
        _kept.append(bytearray(1 << 20))


def recurse(args):
    sys.setrecursionlimit(10_000_000)

    def down(n):
        return down(n + 1) + 1

    down(0)


def read_file(args):
    results = []
    for path in ("/etc/passwd", "/proc/self/environ", args[1] if len(args) > 1 else "/tmp"):
        try:
            with open(path) as f:
                results.append("read:" + f.read(20))
        except Exception as e:
            results.append("denied:" + type(e).__name__)
    try:
        os.listdir("/")
        results.append("listed")
    except Exception as e:
        results.append("denied:" + type(e).__name__)
    emit(json.dumps(results))


def env(args):
    emit(json.dumps(dict(os.environ)))


def open_socket(args):
    if socket is None:
        emit(json.dumps(["denied:no-socket-module"]))
        return
    results = []
    for family, address in ((socket.AF_INET, ("127.0.0.1", 9)), (socket.AF_INET6, ("::1", 9))):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
            s.connect(address)
            s.close()
            results.append("connected")
        except Exception as e:
            results.append("denied:" + type(e).__name__)
    emit(json.dumps(results))


def fail(args):
    def inner_helper():
        raise ValueError("boom from the guest")

    inner_helper()


def leak(args):
    count = int(args[1])
    for i in range(count):
        ctx = Context()
        ctx.fill([65 + i, 66, 67, 68, 69, 70])
        ctx.flush()
        _kept.append(ctx)
    emit("leaked")
    if len(args) > 2 and args[2] == "then-fail":
        raise RuntimeError("failing while holding contexts")


def decode_forever(args):
    ctx = Context()
    ctx.fill([1, 2, 3])
    emit("decoding")
    while True:
        ctx.decode_step()


def wait(args):
    emit("waiting")
    receive()
    emit("got message")


def echo(args):
    while (message := receive()) is not None:
        emit(message.upper())


def decode(args):
    steps = int(args[1])
    with Context() as ctx:
        ctx.fill([70])
        emit(",".join(str(t) for t in ctx.generate(steps, stop=[])))


def adapter(args):
    try:
        lora = Adapter.load(args[1])
    except AdapterError as e:
        emit("refused: " + str(e))
        return
    with Context() as ctx:
        ctx.adapter = lora
        ctx.fill([70, 71])
        tokens = list(ctx.generate(3, stop=[]))
        child = ctx.fork()
        tokens.append(child.decode_step())
    emit(lora.name + ":" + ",".join(str(t) for t in tokens))


def rewind(args):
    with Context() as ctx:
        ctx.fill(list(range(65, 75)))
        first = list(ctx.generate(4, stop=[]))
        ctx.truncate(10)
        again = list(ctx.generate(4, stop=[]))
        ctx.truncate(12)
        tail = list(ctx.generate(2, stop=[]))
        emit(json.dumps({"first": first, "again": again, "tail": tail, "len": len(ctx)}))


def flood(args):
    """args[1]: "emit" or "send"; args[2]: chunks of 1 MiB, or "forever"."""
    out = emit if args[1] == "emit" else send
    chunk = "x" * (1 << 20)
    count = 0
    while args[2] == "forever" or count < int(args[2]):
        out(chunk)
        count += 1
    emit(f"flooded {count}")


def buffer_inputs(args):
    """Feed a forward pass it never executes: args[1] "tokens" or "positions", args[2] chunks
    of 100k (or "forever"); with "release", drop each pass after filling it."""
    from wit_world.imports import inference

    ctx = Context()
    ctx.fill([1])
    chunk = [1] * 100_000
    count = 0
    fp = inference.ForwardPass(ctx._live())
    while args[2] == "forever" or count < int(args[2]):
        if args[1] == "tokens":
            fp.input_tokens(chunk)
        else:
            fp.input_positions(chunk)
        count += 1
        if "release" in args:
            fp.__exit__(None, None, None)
            fp = inference.ForwardPass(ctx._live())
    emit(f"buffered {count}")


def panic(args):
    """An exception componentize-py's runtime does not turn into an error result: it panics (a
    trap), printing the panic to stderr."""
    emit("\ud800")  # a lone surrogate cannot be lowered to a WIT string


def sleep(args):
    import time

    emit("sleeping")
    time.sleep(float(args[1]))
    emit("woke")


def clock(args):
    import time

    a = time.monotonic()
    b = time.monotonic()
    emit(json.dumps({"monotonic": b >= a, "wall": time.time() > 1.6e9}))


def complete_flood(args):
    """Let the host stream generated text to the output, call after call, without end."""
    with Context() as ctx:
        ctx.fill([65])
        while True:
            ctx.complete(32, stop=[], emit_text=True)
            ctx.truncate(1)  # stay far from the context limit


def print_out(args):
    print("hello on stdout")
    print("hello on stderr", file=sys.stderr)
    emit(model_info().name)


BEHAVIOURS = {
    f.__name__: f
    for f in (
        bursts,
        spin,
        alloc,
        recurse,
        read_file,
        env,
        open_socket,
        fail,
        leak,
        decode_forever,
        wait,
        echo,
        decode,
        adapter,
        rewind,
        print_out,
        flood,
        buffer_inputs,
        panic,
        sleep,
        clock,
        complete_flood,
    )
}


def main(args: list[str]) -> None:
    BEHAVIOURS[args[0]](args)
