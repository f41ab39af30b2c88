"""json_decoding: answer a prompt in JSON, constrained by a grammar on the host: any JSON object
(`--json-object`, the default) or JSON valid against `--schema`. The output is the JSON; a last
`send` message says why generation ended ("stop": the JSON is complete, "length": the cap)."""

import json

from inferlet import (
    ArgumentParser,
    ChatMessage,
    Context,
    Grammar,
    GrammarError,
    Greedy,
    InferletError,
    Random,
    TextDecoder,
    emit,
    log,
    render_chat,
    send,
)


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="json_decoding")
    parser.add_argument("--prompt", default="Answer in JSON.")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--json-object", action="store_true", help="any JSON object (the default)")
    kind.add_argument("--schema", default="", help="a JSON schema (JSON text)")
    parser.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="compile a schema even if it uses keywords the engine does not enforce",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    return parser


# Built at import, beside main (a snapshot build does it once, at build time).
PARSER = _parser()


def parse(args: list[str]):
    return PARSER.parse_args(args)


def compile_grammar(schema: str, allow_unsupported: bool) -> Grammar:
    if not schema:
        return Grammar.json_object()
    try:
        # Strict: undeclared properties are refused. Unless allowed, a keyword the engine would
        # compile without enforcing is an error, so whatever comes out validates.
        grammar = Grammar("json-schema", schema, strict=True, reject_unsupported=not allow_unsupported)
    except GrammarError as e:
        raise InferletError(f"json_decoding: schema not accepted: {e}") from None
    if grammar.unsupported:
        log(f"json_decoding: not enforced: {', '.join(grammar.unsupported)}", "warning")
    return grammar


def main(args: list[str]) -> None:
    opts = parse(args)
    grammar = compile_grammar(opts.schema, opts.allow_unsupported)
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    prompt = opts.prompt if opts.raw else render_chat([ChatMessage("user", opts.prompt)])
    matcher = grammar.matcher()
    decoder = TextDecoder()
    finish_reason = "length"
    with Context() as ctx:
        ctx.fill(prompt)
        for _ in range(opts.max_tokens):
            token = ctx.decode_step(sampler, matcher=matcher)
            if not matcher.accept(token):
                raise InferletError(f"json_decoding: the host sampled token {token}, which the grammar refuses")
            if matcher.is_terminated():  # ended on a stop token, which is not part of the JSON
                finish_reason = "stop"
                break
            piece = decoder.push(token)
            if piece:
                emit(piece)
    send(json.dumps({"finish_reason": finish_reason}))
