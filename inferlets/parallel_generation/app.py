"""parallel_generation: one prompt, N branches forked from it, decoded together.

The prompt is computed once; each fork shares its full KV pages (only the partial last page is
copied), and every decode step runs all live branches in the same device pass.
"""

import json

from inferlet import ArgumentParser, Context, Random, TextDecoder, decode_steps, emit, model_info, send


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="parallel_generation")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=-1, help="branch i samples with seed + i")
    return parser


# Built at import: the build's snapshot holds it, and a run only parses.
PARSER = _parser()


def parse(args: list[str]):
    opts = PARSER.parse_args(args)
    if opts.branches < 1 or opts.max_tokens < 0:
        PARSER.error("--branches must be at least 1 and --max-tokens not negative")
    return opts


def main(args: list[str]) -> None:
    opts = parse(args)
    stop = set(model_info().stop_tokens)
    root = Context()
    root.fill(opts.prompt)
    branches = [root.fork() for _ in range(opts.branches)]
    root.release()  # the branches keep the shared prompt pages alive
    samplers = [Random(opts.temperature, seed=-1 if opts.seed < 0 else opts.seed + i) for i in range(opts.branches)]
    texts = [""] * opts.branches
    decoders = [TextDecoder() for _ in branches]
    live = list(range(opts.branches))
    for _ in range(opts.max_tokens):
        if not live:
            break
        # One sampler per call: branches with different seeds go in separate groups.
        groups: dict = {}
        for i in live:
            groups.setdefault(samplers[i], []).append(i)
        for sampler, members in groups.items():
            tokens = decode_steps([branches[i] for i in members], sampler)
            for i, token in zip(members, tokens, strict=True):
                if token in stop:
                    live.remove(i)
                else:
                    texts[i] += decoders[i].push(token)
    for i, text in enumerate(texts):
        emit(f"[{i}] {text}\n")
        branches[i].release()
    send(json.dumps({"branches": texts}))
