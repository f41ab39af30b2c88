"""attention_sink: StreamingLLM-style generation with bounded memory. Every token attends to the
first --sinks tokens and the --window most recent ones; after each step the KV pages wholly
between the two are released, so the context decodes far past what its pages could hold."""

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


def main(args: list[str]) -> None:
    opts = PARSER.parse_args(args)
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    stop = set() if opts.ignore_eos else set(model_info().stop_tokens)
    decoder = TextDecoder()
    released = 0
    with Context() as ctx:
        ctx.attention = Window(opts.window, opts.sinks)
        ctx.fill(opts.prompt)
        for _ in range(opts.max_tokens):
            token = ctx.decode_step(sampler)
            if token in stop:
                break
            emit(decoder.push(token))
            # The next step's keys: the sinks and the window ending at the pending token's slot.
            released += ctx.release_slots(opts.sinks, len(ctx) - opts.window)
    emit(f"\n[released {released} pages]\n")
