"""group (a test inferlet): forward passes (`execute-all`) and decode steps (`decode-all`) of
several contexts handed to the host in one call. args[0] names the case; each case sends one
JSON message or traps."""

import json

from componentize_py_types import Err
from inferlet import Context, InferenceError, Random, decode_steps, send
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


def agree_random(args: list[str]) -> None:
    """decode-all with a seeded sampler per context draws what each context draws alone."""
    samplers = [Random(0.9, seed=s) for s in (1, 2, 3)]
    grouped = [Context() for _ in PROMPTS]
    alone = [Context() for _ in PROMPTS]
    for ctx, prompt in zip(grouped + alone, PROMPTS + PROMPTS, strict=True):
        ctx.fill(prompt)
    for _ in range(6):
        decode_steps(grouped, samplers)
        for ctx, sampler in zip(alone, samplers, strict=True):
            ctx.decode_step(sampler)
    send(json.dumps({"grouped": [c.tokens for c in grouped], "alone": [c.tokens for c in alone]}))


def _ids(*contexts: Context) -> list[int]:
    return [c._live().id() for c in contexts]


def decode_partial(args: list[str]) -> None:
    """One context's step is refused: the others still run, each result in its place."""
    good, bad, other = Context(), Context(), Context()
    results = _inf.decode_all(_ids(good, bad, other), [[65, 66], [10**9], [67]], [Greedy().to_wit()])
    report = [{"error": str(r.value)} if isinstance(r, Err) else {"token": r.value} for r in results]
    report.append({"kv": [good._live().len(), bad._live().len(), other._live().len()]})
    send(json.dumps(report))


def decode_sdk_partial(args: list[str]) -> None:
    """decode_steps raises the failure, and the contexts whose step ran keep their token."""
    good, bad = Context(), Context()
    good.fill([65])
    bad.fill([66])
    bad._tokens[-1] = 10**9  # past the vocabulary: refused by the host
    try:
        decode_steps([good, bad])
    except InferenceError as exc:
        send(json.dumps({"error": str(exc), "good": good.tokens, "committed": good.num_committed}))


def decode_duplicate(args: list[str]) -> None:
    ctx = Context()
    _inf.decode_all(_ids(ctx) * 2, [[65], [66]], [Greedy().to_wit()])


def decode_unknown(args: list[str]) -> None:
    _inf.decode_all([4_000_000_000], [[65]], [Greedy().to_wit()])


def decode_mismatch(args: list[str]) -> None:
    a, b = Context(), Context()
    _inf.decode_all(_ids(a, b), [[65]], [Greedy().to_wit()])


def decode_no_sampler(args: list[str]) -> None:
    _inf.decode_all(_ids(Context()), [[65]], [])


def decode_released(args: list[str]) -> None:
    ctx = Context()
    ctx.fill([65])
    rep = ctx._live().id()
    ctx.release()
    _inf.decode_all([rep], [[65]], [Greedy().to_wit()])


CASES = {
    "agree": agree,
    "agree_random": agree_random,
    "partial": partial,
    "duplicate": duplicate,
    "unknown": unknown,
    "released": released,
    "empty": empty,
    "decode_partial": decode_partial,
    "decode_sdk_partial": decode_sdk_partial,
    "decode_duplicate": decode_duplicate,
    "decode_unknown": decode_unknown,
    "decode_mismatch": decode_mismatch,
    "decode_no_sampler": decode_no_sampler,
    "decode_released": decode_released,
}


def main(args: list[str]) -> None:
    CASES[args[0]](args)
