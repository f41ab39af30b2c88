"""sampling_chain (benchmarks): one context decoding `--tokens` tokens with a six-stage sampler
(logit bias, penalties, temperature, top-k, top-p, min-p), run four ways: `greedy` (no stages),
`random` (the last four stages, a plain `Random`), `driver` (the six stages as a `Chain`, run by
the driver) and `guest` (the same stages written here, in Python, over the top 20 tokens each
step reports)."""

import math
import random

from inferlet import (
    ArgumentParser,
    Chain,
    Context,
    LogitBias,
    MinP,
    Penalties,
    Random,
    Temperature,
    TopK,
    TopP,
    emit,
)

PARSER = ArgumentParser(prog="sampling_chain")
PARSER.add_argument("--mode", choices=["greedy", "random", "driver", "guest"], default="driver")
PARSER.add_argument("--tokens", type=int, default=64)
PARSER.add_argument("--seed", type=int, default=1)

PROMPT = "Once upon a time, in a small village by the sea, there lived"
BIAS = {13: -100.0, 30: 1.0}  # ban one token, favour another
REPETITION, PRESENCE, FREQUENCY = 1.1, 0.3, 0.3
TEMPERATURE, TOP_K, TOP_P, MIN_P = 0.8, 40, 0.95, 0.05
PROBE_K = 20  # the most a probe reports


def guest_pick(choices, counts: dict[int, int], rng: random.Random) -> int:
    """The chain over the top tokens the probe reported (logprobs differ from logits by one
    constant per row, so penalties and filters apply to them as to logits)."""
    scored = []
    for choice in choices:
        value = choice.logprob + BIAS.get(choice.token, 0.0)
        seen = counts.get(choice.token, 0)
        if seen:
            value = value / REPETITION if value > 0 else value * REPETITION
            value -= PRESENCE + FREQUENCY * seen
        scored.append((value / TEMPERATURE, choice.token))
    scored.sort(reverse=True)
    scored = scored[:TOP_K]
    top = scored[0][0]
    probs = [math.exp(v - top) for v, _ in scored]
    total = sum(probs)
    kept, mass = [], 0.0
    for (_, token), p in zip(scored, probs, strict=True):
        if (kept and mass >= TOP_P * total) or p < MIN_P:
            break
        kept.append((token, p))
        mass += p
    draw = rng.random() * sum(p for _, p in kept)
    for token, p in kept:
        draw -= p
        if draw < 0:
            return token
    return kept[-1][0]


def main(args: list[str]) -> None:
    opts = PARSER.parse_args(args)
    with Context() as ctx:
        ctx.fill(PROMPT)
        start = len(ctx)
        if opts.mode == "greedy":
            for _ in range(opts.tokens):
                ctx.decode_step()
        elif opts.mode == "random":  # the sampler's last four stages only, in the one-call decode
            sampler = Random(TEMPERATURE, TOP_K, TOP_P, MIN_P, seed=opts.seed)
            for _ in range(opts.tokens):
                ctx.decode_step(sampler)
        elif opts.mode == "driver":
            sampler = Chain(
                LogitBias(BIAS),
                Penalties(REPETITION, PRESENCE, FREQUENCY, since=start, repetition_since=start),
                Temperature(TEMPERATURE),
                TopK(TOP_K),
                TopP(TOP_P),
                MinP(MIN_P),
                seed=opts.seed,
            )
            for _ in range(opts.tokens):
                ctx.decode_step(sampler)
        else:
            rng = random.Random(opts.seed)
            counts: dict[int, int] = {}
            for _ in range(opts.tokens):
                token = guest_pick(ctx.top_k(PROBE_K), counts, rng)
                counts[token] = counts.get(token, 0) + 1
                ctx.fill([token])
        emit(str(len(ctx) - start))
