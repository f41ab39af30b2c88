"""parallel_generation: one prompt, N branches forked from it, decoded together; best-of-n.

The prompt is computed once; each fork shares its full KV pages (only the partial last page is
copied), and every decode step runs all live branches in the same device pass, each with its
own sampler (branch i seeded seed + i). Each branch is scored by the sum of its tokens' logprobs;
`--best` emits only the best branch.
"""

import json

from inferlet import ArgumentParser, Context, Random, TextDecoder, decode_steps_with_logprobs, emit, model_info, send


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="parallel_generation")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=-1, help="branch i samples with seed + i")
    parser.add_argument("--best", action="store_true", help="emit only the branch with the highest logprob")
    parser.add_argument("--ignore-eos", action="store_true", help="decode --max-tokens tokens in every branch")
    return parser


# Built at import, beside main (a snapshot build does it once, at build time).
PARSER = _parser()


def parse(args: list[str]):
    opts = PARSER.parse_args(args)
    if opts.branches < 1 or opts.max_tokens < 0:
        PARSER.error("--branches must be at least 1 and --max-tokens not negative")
    return opts


def main(args: list[str]) -> None:
    opts = parse(args)
    stop = set() if opts.ignore_eos else set(model_info().stop_tokens)
    root = Context()
    root.fill(opts.prompt)
    branches = [root.fork() for _ in range(opts.branches)]
    root.release()  # the branches keep the shared prompt pages alive
    samplers = [Random(opts.temperature, seed=-1 if opts.seed < 0 else opts.seed + i) for i in range(opts.branches)]
    texts = [""] * opts.branches
    scores = [0.0] * opts.branches
    decoders = [TextDecoder() for _ in branches]
    live = list(range(opts.branches))
    for _ in range(opts.max_tokens):
        if not live:
            break
        # One pass for every live branch, each with its own sampler.
        choices = decode_steps_with_logprobs([branches[i] for i in live], [samplers[i] for i in live])
        for i, choice in zip(list(live), choices, strict=True):
            scores[i] += choice.logprob
            if choice.token in stop:
                live.remove(i)
            else:
                texts[i] += decoders[i].push(choice.token)
    best = max(range(opts.branches), key=lambda i: scores[i])
    for i, text in enumerate(texts):
        if not opts.best or i == best:
            emit(f"[{i}] {text}\n")
        branches[i].release()
    send(json.dumps({"branches": texts, "logprobs": [round(s, 4) for s in scores], "best": best}))
