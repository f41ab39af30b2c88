"""hierarchical_attention: generate with a hierarchical sparse attention mask. The context is
cut into chunks; a query sees the sinks, a few summary tokens of every chunk, the whole of the
chunks most relevant to it (a lexical score), and a recent window (the rule: hierarchy.py)."""

from hierarchy import Hierarchy
from inferlet import ArgumentParser, Context, Greedy, InferletError, Random, TextDecoder, emit, model_info


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="hierarchical_attention")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chunk", type=int, default=32, help="tokens per chunk")
    parser.add_argument("--summary", type=int, default=4, help="first tokens of every chunk each query sees")
    parser.add_argument("--top", type=int, default=2, help="most relevant chunks each query sees whole")
    parser.add_argument("--window", type=int, default=32, help="recent tokens each query sees")
    parser.add_argument("--sinks", type=int, default=4, help="first tokens of the context each query sees")
    parser.add_argument("--query-tokens", type=int, default=16, help="recent tokens the relevance score uses")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    return parser


# Built at import, beside main (a snapshot build does it once, at build time).
PARSER = _parser()


def parse(args: list[str]):
    return PARSER.parse_args(args)


def main(args: list[str]) -> None:
    opts = parse(args)
    try:
        rule = Hierarchy(opts.chunk, opts.summary, opts.top, opts.window, opts.sinks, opts.query_tokens)
    except ValueError as e:
        raise InferletError(f"hierarchical_attention: {e}") from None
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    stop = set() if opts.ignore_eos else set(model_info().stop_tokens)
    decoder = TextDecoder()
    with Context() as ctx:
        ctx.fill(opts.prompt)
        for _ in range(opts.max_tokens):
            # One row per pending token: the whole prompt on the first step, then one per step.
            rows = rule.rows(ctx.tokens, ctx.num_committed)
            token = ctx.decode_step(sampler, attention_rows=rows)
            if token in stop:
                break
            piece = decoder.push(token)
            if piece:
                emit(piece)
