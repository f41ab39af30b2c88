"""attention_sink: StreamingLLM-style generation with bounded memory. Every token attends to the
first --sinks tokens and the --window most recent ones; after each step the KV pages wholly
between the two are released, so the context decodes far past what its pages could hold. When
its positions run out (the model's context length), it goes on in a new context that holds the
sinks and the window."""

from inferlet import ArgumentParser, Context, Greedy, Random, TextDecoder, Window, emit, model_info


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="attention_sink")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--window", type=int, default=64, help="recent keys each token sees")
    parser.add_argument("--sinks", type=int, default=4, help="first keys every token sees")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    return parser


# Built at import, beside main (a snapshot build does it once, at build time).
PARSER = _parser()


def roll_over(ctx: Context, sinks: int, window: int) -> Context:
    """The context's positions are used up (`model_info().max_context`): go on in a new one
    that holds the sinks and the window, re-positioned from 0 (what StreamingLLM does to its
    cache), and release the old one."""
    tokens = ctx.tokens
    fresh = Context()
    fresh.attention = ctx.attention
    fresh.fill(tokens[:sinks] + tokens[-window:])  # the last is the pending token
    ctx.release()
    return fresh


def main(args: list[str]) -> None:
    opts = PARSER.parse_args(args)
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    stop = set() if opts.ignore_eos else set(model_info().stop_tokens)
    decoder = TextDecoder()
    released = rolled = 0
    ctx = Context()
    try:
        ctx.attention = Window(opts.window, opts.sinks)
        ctx.fill(opts.prompt)
        for _ in range(opts.max_tokens):
            if ctx.room == 0:
                ctx = roll_over(ctx, opts.sinks, opts.window)
                rolled += 1
            token = ctx.decode_step(sampler)
            if token in stop:
                break
            emit(decoder.push(token))
            # The next step's keys: the sinks and the window ending at the pending token's slot.
            released += ctx.release_slots(opts.sinks, len(ctx) - opts.window)
    finally:
        ctx.release()
    emit(f"\n[released {released} pages, rolled over {rolled} times]\n")
