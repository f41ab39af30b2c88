"""text_completion: complete a prompt, streaming the completion as it is generated."""

from inferlet import ArgumentParser, ChatMessage, Context, Greedy, Random, emit, render_chat


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="text_completion")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate --max-tokens tokens even past stop tokens (benchmarks)"
    )
    parser.add_argument(
        "--per-token",
        action="store_true",
        help="run the generation loop in the inferlet, one host call per token, instead of on the host",
    )
    return parser


# Built at import, beside main (a snapshot build does it once, at build time: 1.4 ms less a run).
PARSER = _parser()


def parse(args: list[str]):
    return PARSER.parse_args(args)


def main(args: list[str]) -> None:
    opts = parse(args)
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, top_p=opts.top_p, seed=opts.seed)
    prompt = render_chat([ChatMessage("user", opts.prompt)]) if opts.chat else opts.prompt
    with Context() as ctx:
        ctx.fill(prompt)
        stop = [] if opts.ignore_eos else None
        if not opts.per_token:
            ctx.complete(max_tokens=opts.max_tokens, stop=stop, sampler=sampler, emit_text=True)
            return
        for piece in ctx.generate_text(max_tokens=opts.max_tokens, stop=stop, sampler=sampler):
            emit(piece)
