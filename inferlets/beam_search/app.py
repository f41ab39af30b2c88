"""beam_search: keep the `width` most likely partial completions, extend each by its top
candidates, and print the best finished one."""

import json

from inferlet import ArgumentParser, Context, detokenize, emit, model_info, send, top_k_all


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="beam_search")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--beam-width", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--length-penalty", type=float, default=1.0, help="score = logprob / length**penalty")
    return parser


# Built at import, beside main (a snapshot build does it once, at build time).
PARSER = _parser()


def parse(args: list[str]):
    opts = PARSER.parse_args(args)
    if opts.beam_width < 1 or opts.max_tokens < 1:
        PARSER.error("--beam-width and --max-tokens must be at least 1")
    return opts


class Beam:
    def __init__(self, ctx: Context, tokens: list[int], logprob: float) -> None:
        self.ctx = ctx
        self.tokens = tokens
        self.logprob = logprob

    def score(self, penalty: float) -> float:
        return self.logprob / max(len(self.tokens), 1) ** penalty


def main(args: list[str]) -> None:
    opts = parse(args)
    stop = set(model_info().stop_tokens)
    root = Context()
    root.fill(opts.prompt)
    beams = [Beam(root, [], 0.0)]
    finished: list[Beam] = []
    for _ in range(opts.max_tokens):
        choices = top_k_all([b.ctx for b in beams], opts.beam_width)
        candidates = [(b.logprob + c.logprob, b, c.token) for b, cs in zip(beams, choices, strict=True) for c in cs]
        candidates.sort(key=lambda x: x[0], reverse=True)
        next_beams: list[Beam] = []
        for logprob, parent, token in candidates:
            if len(next_beams) + len(finished) >= opts.beam_width:
                break
            if token in stop:
                finished.append(Beam(parent.ctx, parent.tokens, logprob))
                continue
            child = parent.ctx.fork()
            child.fill([token])
            next_beams.append(Beam(child, [*parent.tokens, token], logprob))
        for b in beams:
            if not any(b.ctx is f.ctx for f in finished):
                b.ctx.release()
        beams = next_beams
        if not beams:
            break
    pool = finished + beams
    best = max(pool, key=lambda b: b.score(opts.length_penalty))
    text = detokenize(best.tokens)
    emit(text)
    send(json.dumps({"text": text, "tokens": best.tokens, "logprob": best.logprob}))
