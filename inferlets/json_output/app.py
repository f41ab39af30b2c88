"""json_output: answer a prompt in JSON, constrained by a grammar on the host: any JSON object,
or JSON valid against a given schema. The output always parses (unless --max-tokens cuts it)."""

from inferlet import (
    ArgumentParser,
    ChatMessage,
    Context,
    Grammar,
    GrammarError,
    Greedy,
    InferletError,
    Random,
    emit,
    render_chat,
)


def main(args: list[str]) -> None:
    parser = ArgumentParser(prog="json_output")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--schema", default="", help="a JSON schema (JSON text); default: any JSON object")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--seed", type=int, default=-1)
    parser.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    opts = parser.parse_args(args)
    try:
        grammar = Grammar.json_schema(opts.schema) if opts.schema else Grammar.json_object()
    except GrammarError as e:
        raise InferletError(f"json_output: bad schema: {e}") from None
    sampler = Greedy() if opts.temperature == 0 else Random(opts.temperature, seed=opts.seed)
    prompt = opts.prompt if opts.raw else render_chat([ChatMessage("user", opts.prompt)])
    with Context() as ctx:
        ctx.fill(prompt)
        for piece in ctx.generate_text(max_tokens=opts.max_tokens, sampler=sampler, grammar=grammar):
            emit(piece)
