"""windowed_attention: generate with a causal sliding window and attention sinks (as in
StreamingLLM): each token attends only to the context's first --sinks tokens and its --window
most recent ones, so a long generation costs its window per step, not its whole context."""

from inferlet import ArgumentParser, Context, Greedy, Random, Window, emit


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="windowed_attention")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--window", type=int, default=64, help="recent keys each token sees")
    parser.add_argument("--sinks", type=int, default=4, help="first keys every token sees (0 = none)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    return parser


# Built at import, beside main (a snapshot build does it once, at build time).
PARSER = _parser()


def main(args: list[str]) -> None:
    opts = PARSER.parse_args(args)
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    with Context() as ctx:
        ctx.attention = Window(opts.window, opts.sinks)
        ctx.fill(opts.prompt)
        stop = [] if opts.ignore_eos else None
        for piece in ctx.generate_text(max_tokens=opts.max_tokens, stop=stop, sampler=sampler):
            emit(piece)
