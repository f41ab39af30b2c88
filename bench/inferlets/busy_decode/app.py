"""busy_decode (benchmarks): greedy decode steps with a fixed amount of guest work per token,
standing in for an inferlet that thinks between steps."""

import time

from inferlet import ArgumentParser, Context, emit

# Built at import: the build's snapshot holds it, and a run only parses.
PARSER = ArgumentParser(prog="busy_decode")
PARSER.add_argument("--tokens", type=int, default=100)
PARSER.add_argument("--work-us", type=int, default=500, help="guest work per token, microseconds")


def main(args: list[str]) -> None:
    opts = PARSER.parse_args(args)
    with Context() as ctx:
        ctx.fill("Once upon a time")
        for _ in range(opts.tokens):
            ctx.decode_step()
            deadline = time.perf_counter() + opts.work_us / 1e6
            while time.perf_counter() < deadline:  # work, not sleep: the guest stays busy
                pass
    emit(str(opts.tokens))
