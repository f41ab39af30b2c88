"""digits: write a number. A logit mask on every step allows only the tokens of the digits 0-9,
so the output is digits whatever the model would rather say."""

from inferlet import ArgumentParser, Context, Greedy, LogitMask, Random, detokenize, emit, model_info, tokenize


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="digits")
    parser.add_argument("--prompt", default="A random number: ")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=-1)
    return parser


# Built at import, beside main (a snapshot build does it once, at build time).
PARSER = _parser()


def main(args: list[str]) -> None:
    opts = PARSER.parse_args(args)
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    digit_tokens = {t for d in "0123456789" for t in tokenize(d)}
    mask = LogitMask.allow(digit_tokens, model_info().vocab_size)
    with Context() as ctx:
        ctx.fill(opts.prompt)
        for _ in range(opts.max_tokens):
            ctx.decode_step(sampler, logit_mask=mask)
        emit(detokenize(ctx.tokens[-opts.max_tokens :]))
