"""spec_ngram: speculative decoding by prompt lookup. Each step looks for the latest earlier
occurrence of the context's last n tokens and drafts the tokens that followed it; one pass then
verifies the whole draft (a sampler on every row) and keeps the longest agreeing prefix plus
the model's own next token. The output is exactly what plain decoding gives; copy-heavy tasks
(rewriting, quoting, code edits) go faster."""

from inferlet import (
    ArgumentParser,
    ChatMessage,
    Context,
    Grammar,
    Greedy,
    Random,
    TextDecoder,
    emit,
    model_info,
    render_chat,
    send,
)


def lookup(tokens: list[int], max_ngram: int, num_draft: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of the longest matching suffix."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_draft]
    return []


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="spec_ngram")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ngram", type=int, default=3, help="longest suffix to look up")
    parser.add_argument("--draft", type=int, default=6, help="draft tokens per step")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    # For tests and benchmarks: where drafts come from.
    parser.add_argument("--drafts", choices=["lookup", "oracle", "bad"], default="lookup")
    parser.add_argument("--oracle", default="", help="comma-separated token ids to draft from (--drafts oracle)")
    return parser


# Built at import, beside main (a snapshot build does it once, at build time).
PARSER = _parser()


def main(args: list[str]) -> None:
    opts = PARSER.parse_args(args)
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    matcher = Grammar.json_object().matcher() if opts.json else None
    stop = set(model_info().stop_tokens)
    oracle = [int(t) for t in opts.oracle.split(",") if t]
    decoder = TextDecoder()
    generated, drafted, accepted_total, passes = 0, 0, 0, 0
    with Context() as ctx:
        ctx.fill(render_chat([ChatMessage("user", opts.prompt)]) if opts.chat else opts.prompt)
        start = len(ctx)
        while generated < opts.max_tokens:
            room = opts.max_tokens - generated - 1
            if opts.drafts == "oracle":
                draft = oracle[generated : generated + min(opts.draft, room)]
            elif opts.drafts == "bad":
                draft = [_unlikely(ctx.tokens)] * min(opts.draft, room)
            else:
                draft = lookup(ctx.tokens, opts.ngram, min(opts.draft, room))
            if generated == 0:
                draft = []  # the first token comes from the prompt's own pass
            if draft:
                accepted, _ = ctx.verify(draft, sampler, matcher)
                drafted += len(draft)
                accepted_total += accepted
            else:
                token = ctx.decode_step(sampler, matcher=matcher)
                if matcher is not None:
                    matcher.accept(token)
            passes += 1
            new = ctx.tokens[start + generated :]
            done = False
            for token in new:
                if token in stop or (matcher is not None and matcher.is_terminated() and token in stop):
                    done = True
                    break
                emit(decoder.push(token))
                generated += 1
                if generated >= opts.max_tokens:
                    done = True
                    break
            if done or (matcher is not None and matcher.is_terminated()):
                break
        tokens = ctx.tokens[start : start + generated]
    stats = f'"generated": {generated}, "drafted": {drafted}, "accepted": {accepted_total}, "passes": {passes}'
    send("{" + stats + f', "tokens": {tokens}' + "}")


def _unlikely(tokens: list[int]) -> int:
    """A draft token the model will not predict next: the first control token (never text)."""
    controls = model_info().control_tokens
    return controls[0] if controls else (tokens[-1] + 1) % model_info().vocab_size
