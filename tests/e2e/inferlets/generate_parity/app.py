"""generate_parity (a test inferlet): runs the same generation twice, once with the guest's
per-token loop (`Context.generate`) and once with the host's loop (`Context.complete`), and
sends both results as one JSON message. Also probes `forward-pass.generate`'s refusals."""

import json

from inferlet import Context, Grammar, InferenceError, Random, Window, model_info, send
from inferlet.sampling import Greedy
from wit_world.imports import inference as _inf

CASES = {
    "greedy": {"max_tokens": 24, "stop": []},
    "default_stop": {"max_tokens": 200},
    "stop_list": {"max_tokens": 200, "stop": list(range(97, 123))},  # any lowercase letter
    "random": {"max_tokens": 24, "stop": [], "sampler": Random(0.9, top_p=0.95, seed=7)},
    "grammar": {"max_tokens": 64, "grammar": r"(yes|no|maybe)!{1,3}"},  # compiled at run time
    "window": {"max_tokens": 24, "stop": [], "window": Window(8, 2)},
    "one": {"max_tokens": 1, "stop": []},
    "zero": {"max_tokens": 0, "stop": []},
}


def run_case(name: str, host: bool) -> dict:
    case = CASES[name]
    sampler = case.get("sampler", Greedy())
    with Context() as ctx:
        ctx.attention = case.get("window")
        ctx.fill(f"A test of {name}: ")
        kwargs = {"max_tokens": case["max_tokens"], "sampler": sampler}
        if "stop" in case:
            kwargs["stop"] = case["stop"]
        if "grammar" in case:  # (no host calls at import: the build snapshots the module)
            kwargs["grammar"] = Grammar.regex(case["grammar"])
        if host:
            tokens = ctx.complete(**kwargs).tokens
        else:
            tokens = list(ctx.generate(**kwargs))
        # The context's state after the loop: every token, and how many are in the KV.
        return {"tokens": tokens, "all": ctx.tokens, "committed": ctx.num_committed, "kv_length": ctx._live().len()}


def refusals() -> list[str]:
    """What `forward-pass.generate` says to passes it cannot repeat."""
    errors = []
    with Context() as ctx:
        ctx.fill("xyz")
        todo = ctx.pending
        shapes = [
            lambda fp: (fp.output(0, Greedy().to_wit(), _inf.Probe(0), 0),),
            lambda fp: (fp.output(len(todo) - 1, Greedy().to_wit(), _inf.Probe.LOGPROBS, 2),),
            lambda fp: (
                fp.input_positions(list(range(len(todo)))),
                fp.output(len(todo) - 1, Greedy().to_wit(), _inf.Probe(0), 0),
            ),
        ]
        for shape in shapes:
            with _inf.ForwardPass(ctx._live()) as fp:
                fp.input_tokens(todo)
                shape(fp)
                result = fp.generate(4, [], False)
                errors.append(result.error or "")
                assert not result.tokens
    return errors


def exhaust() -> dict:
    """Generate until the host runs out of pages: the error comes with the tokens before it."""
    with Context() as ctx:
        ctx.fill("Fill the pages: ")
        try:
            ctx.complete(max_tokens=100_000, stop=[])
        except InferenceError as exc:
            return {
                "error": str(exc),
                "all": len(ctx.tokens),
                "committed": ctx.num_committed,
                "kv_length": ctx._live().len(),
            }
    return {"error": None}


def main(args: list[str]) -> None:
    if args == ["exhaust"]:
        send(json.dumps(exhaust()))
        return
    if args == ["refusals"]:
        send(json.dumps(refusals()))
        return
    name = args[0]
    guest, host = run_case(name, False), run_case(name, True)
    send(json.dumps({"guest": guest, "host": host, "stop": list(model_info().stop_tokens)}))
