"""chains (tests): sampler chains through every SDK path that takes a sampler. Emits one line
per path: the tokens' text."""

from inferlet import (
    DRY,
    XTC,
    Chain,
    Context,
    Greedy,
    LogitBias,
    LogitMask,
    Mirostat,
    Penalties,
    Temperature,
    TopK,
    TopNSigma,
    Typical,
    decode_steps,
    detokenize,
    emit,
    model_info,
)


def main(args: list[str]) -> None:
    info = model_info()
    emit(f"probe k {info.max_probe_k}\n")
    with Context() as ctx:
        ctx.fill("xyz")
        no_repeat = Chain(Penalties(presence=1.0, since=len(ctx)), Greedy())
        emit("decode_step " + detokenize([ctx.decode_step(no_repeat) for _ in range(5)]) + "\n")
    with Context() as ctx:
        ctx.fill("xyz")
        done = ctx.complete(5, stop=[], sampler=Chain(Penalties(frequency=0.5, since=len(ctx)), Greedy()))
        emit("complete " + detokenize(done.tokens) + "\n")
    with Context() as a, Context() as b:
        a.fill("xyz")
        b.fill("xyz")
        samplers = [no_repeat, Chain(LogitBias({ord("z"): 100.0}), Greedy())]
        steps = [decode_steps([a, b], samplers) for _ in range(3)]
        emit("decode_steps " + "|".join(detokenize(list(col)) for col in zip(*steps, strict=True)) + "\n")
    with Context() as ctx:
        ctx.fill("xyz")
        mask = LogitMask.forbid([ord("a")], info.vocab_size)
        emit("masked " + detokenize([ctx.decode_step(no_repeat, logit_mask=mask) for _ in range(3)]) + "\n")
    with Context() as ctx:
        ctx.fill("xyz")
        dry = Chain(DRY(1.0, 2.0, 2), Greedy())
        emit("dry " + detokenize([ctx.decode_step(dry) for _ in range(8)]) + "\n")
    with Context() as ctx:
        ctx.fill("xyz")
        # At temperature 0.3 a is 74% likely, b 20%: XTC at 0.15 leaves b and c of the top three.
        xtc = Chain(XTC(1.0, 0.15), TopK(3), Temperature(0.3), Typical(0.99), TopNSigma(50.0), seed=3)
        emit("xtc " + detokenize([ctx.decode_step(xtc) for _ in range(6)]) + "\n")
    with Context() as ctx:
        ctx.fill("xyz")
        # The one call with masks and logprobs: b forbidden; what it chose from, best first.
        mask = LogitMask.forbid([ord("b")], info.vocab_size)
        chosen, top = ctx.step(no_repeat, logit_mask=mask, top_k=2)
        second, _ = ctx.step(no_repeat, top_k=0)
        names = [detokenize([c.token]) for c in top]
        emit(f"step {detokenize([chosen.token])} {chosen.logprob:.3f} {names} {detokenize([second.token])}\n")
    with Context() as ctx:
        ctx.fill("xyz")
        # Mirostat 2 at tau 3.5: mu starts at 7 bits, below the 8.2 of the 256 plain tokens.
        steady = Chain(Mirostat(3.5, 0.1), seed=2)
        emit("mirostat " + detokenize([ctx.decode_step(steady) for _ in range(8)]) + "\n")
