"""group (a test inferlet): forward passes of several contexts handed to the host in one
`execute-all` call. args[0] names the case; each case sends one JSON message or traps."""

import json

from componentize_py_types import Err
from inferlet import Context, decode_steps, send
from inferlet.sampling import Greedy
from wit_world.imports import inference as _inf

PROMPTS = ["Alpha: ", "A longer second prompt: ", "3"]


def agree(args: list[str]) -> None:
    """The same greedy steps, grouped and one context at a time, give the same tokens."""
    grouped = [Context() for _ in PROMPTS]
    alone = [Context() for _ in PROMPTS]
    for ctx, prompt in zip(grouped + alone, PROMPTS + PROMPTS, strict=True):
        ctx.fill(prompt)
    for _ in range(6):
        decode_steps(grouped)
        for ctx in alone:
            ctx.decode_step()
    send(json.dumps({"grouped": [c.tokens for c in grouped], "alone": [c.tokens for c in alone]}))


def _pass(ctx: Context, tokens: list[int]) -> _inf.ForwardPass:
    fp = _inf.ForwardPass(ctx._live())
    fp.input_tokens(tokens)
    fp.output(len(tokens) - 1, Greedy().to_wit(), _inf.Probe(0), 0)
    return fp


def partial(args: list[str]) -> None:
    """One pass of the group is refused: the others still run, each result in its place."""
    good, bad, other = Context(), Context(), Context()
    passes = [_pass(good, [65, 66]), _pass(bad, [10**9]), _pass(other, [67])]
    results = _inf.execute_all([fp.id() for fp in passes])
    report = []
    for result in results:
        if isinstance(result, Err):
            report.append({"error": str(result.value)})
        else:
            report.append({"tokens": [out.token for out in result.value]})
    report.append({"kv": [good._live().len(), bad._live().len(), other._live().len()]})
    send(json.dumps(report))


def duplicate(args: list[str]) -> None:
    ctx = Context()
    fp = _pass(ctx, [65])
    _inf.execute_all([fp.id(), fp.id()])


def unknown(args: list[str]) -> None:
    _inf.execute_all([4_000_000_000])


def released(args: list[str]) -> None:
    ctx = Context()
    fp = _pass(ctx, [65])
    rep = fp.id()
    fp.__exit__(None, None, None)
    _inf.execute_all([rep])


def empty(args: list[str]) -> None:
    send(json.dumps(_inf.execute_all([])))


def main(args: list[str]) -> None:
    {"agree": agree, "partial": partial, "duplicate": duplicate, "unknown": unknown, "released": released,
     "empty": empty}[args[0]](args)
