"""tool_call: answer a prompt with one call of a given tool, `{"name":...,"arguments":{...}}`,
the arguments valid against the tool's parameter schema (a grammar on the host masks every step).
A last `send` message says why generation ended ("stop": the call is complete, "length": the cap)."""

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
    parser = ArgumentParser(prog="tool_call")
    parser.add_argument("--prompt", default="Call the tool.")
    parser.add_argument("--tools", required=True, help="OpenAI function tools (a JSON list)")
    parser.add_argument("--choice", default="required", help='a tool name, or "required" (any one tool)')
    parser.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="compile parameter schemas even if they use keywords the engine does not enforce",
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


def compile_grammar(tools: str, choice: str, allow_unsupported: bool) -> Grammar:
    if choice == "auto":
        raise InferletError('tool_call: --choice must name a tool or be "required" (a call is always made)')
    try:
        grammar = Grammar("tool-call", tools, choice=choice, reject_unsupported=not allow_unsupported)
    except GrammarError as e:
        raise InferletError(f"tool_call: tools not accepted: {e}") from None
    if grammar.unsupported:
        log(f"tool_call: not enforced: {', '.join(grammar.unsupported)}", "warning")
    return grammar


def main(args: list[str]) -> None:
    opts = parse(args)
    grammar = compile_grammar(opts.tools, opts.choice, opts.allow_unsupported)
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    if opts.raw:
        prompt = opts.prompt
    else:
        system = "You call tools. Answer with one call, as JSON. The tools: " + opts.tools
        prompt = render_chat([ChatMessage("system", system), ChatMessage("user", opts.prompt)])
    matcher = grammar.matcher()
    decoder = TextDecoder()
    finish_reason = "length"
    with Context() as ctx:
        ctx.fill(prompt)
        for _ in range(opts.max_tokens):
            token = ctx.decode_step(sampler, matcher=matcher)
            if not matcher.accept(token):
                raise InferletError(f"tool_call: the host sampled token {token}, which the grammar refuses")
            if matcher.is_terminated():  # ended on a stop token, which is not part of the call
                finish_reason = "stop"
                break
            piece = decoder.push(token)
            if piece:
                emit(piece)
    send(json.dumps({"finish_reason": finish_reason}))
