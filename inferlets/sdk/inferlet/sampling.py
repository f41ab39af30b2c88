"""Samplers: how an output row picks its token."""

from __future__ import annotations

from dataclasses import dataclass

from wit_world.imports import inference as _inf

from inferlet.checks import need


@dataclass(frozen=True)
class Greedy:
    """Always the most likely token."""

    def to_wit(self) -> _inf.Sampler:
        return _inf.Sampler(_inf.SamplerKind.GREEDY, 1.0, 0, 1.0, 0.0, -1)


@dataclass(frozen=True)
class Random:
    """Sample at `temperature`, keeping the `top_k` most likely tokens (0: all), the smallest set
    of probability `top_p`, and tokens at least `min_p` times as likely as the best. `seed` -1
    draws a fresh seed; any other value makes the choice reproducible."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = -1

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            need(getattr(self, name), (float, int), f"Random's {name}")
        for name in ("top_k", "seed"):
            need(getattr(self, name), int, f"Random's {name}")
        if self.temperature <= 0:
            raise ValueError("temperature must be positive (use Greedy() for temperature 0)")
        if not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1 or self.top_k < 0:
            raise ValueError("need 0 < top_p <= 1, 0 <= min_p <= 1 and top_k >= 0")

    def to_wit(self) -> _inf.Sampler:
        return _inf.Sampler(_inf.SamplerKind.RANDOM, self.temperature, self.top_k, self.top_p, self.min_p, self.seed)


_Stages = tuple[list[tuple[int, float]], "_inf.Penalties | None", "_inf.Filters | None", "_inf.Dry | None"]


@dataclass(frozen=True)
class Penalties:
    """Penalties over the tokens already in the context, applied in the driver before the draw.
    `repetition` divides the positive logit (multiplies the negative one) of every token seen
    since slot `repetition_since` (1: off; vLLM's repetition_penalty); `presence` is subtracted
    once and `frequency` once per occurrence from every token seen since slot `since` (0: off;
    OpenAI's penalties count the completion only: pass `since=len(ctx)` before generating).
    `last_n` > 0 counts only the last n slots (llama.cpp's penalty_last_n)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    since: int = 0
    repetition_since: int = 0
    last_n: int = 0

    def __post_init__(self) -> None:
        for name in ("repetition", "presence", "frequency"):
            need(getattr(self, name), (float, int), f"Penalties' {name}")
        for name in ("since", "repetition_since", "last_n"):
            need(getattr(self, name), int, f"Penalties' {name}")
        if not self.repetition > 0 or min(self.since, self.repetition_since, self.last_n) < 0:
            raise ValueError("need repetition > 0 and since, repetition_since, last_n >= 0")

    def to_wit(self) -> _inf.Penalties:
        return _inf.Penalties(
            self.repetition, self.presence, self.frequency, self.since, self.repetition_since, self.last_n
        )


@dataclass(frozen=True)
class LogitBias:
    """Add a value to some tokens' logits before the draw: {token: value}; -100 bans a token in
    practice, +100 forces it."""

    bias: dict[int, float]

    def __post_init__(self) -> None:
        need(self.bias, dict, "LogitBias' bias")
        for token, value in self.bias.items():
            need(token, int, "a LogitBias token")
            need(value, (float, int), "a LogitBias value")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.bias.items())))


@dataclass(frozen=True)
class DRY:
    """llama.cpp's "don't repeat yourself", applied in the driver after the penalties: a token
    that would continue a run already seen in the context, at least `allowed_length` tokens
    long, loses `multiplier * base ** (length - allowed_length)` of its logit. A run never
    reaches back past a token of `breakers` (token ids: e.g. those of newlines and quotes);
    `last_n` > 0 looks at the last n slots only. `multiplier` 0 is off."""

    multiplier: float = 0.8
    base: float = 1.75
    allowed_length: int = 2
    last_n: int = 0
    breakers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        need(self.multiplier, (float, int), "DRY's multiplier")
        need(self.base, (float, int), "DRY's base")
        need(self.allowed_length, int, "DRY's allowed_length")
        need(self.last_n, int, "DRY's last_n")
        for token in self.breakers:
            need(token, int, "a DRY breaker")
        if not (self.multiplier >= 0 and self.base >= 1 and self.allowed_length >= 0 and self.last_n >= 0):
            raise ValueError("DRY needs multiplier >= 0, base >= 1, allowed_length >= 0 and last_n >= 0")

    def to_wit(self) -> _inf.Dry:
        return _inf.Dry(self.multiplier, self.base, self.allowed_length, self.last_n, list(self.breakers))


@dataclass(frozen=True, init=False)
class Chain:
    """Samplers that compose: stages the driver applies to a row's logits, then the draw, e.g.
    `Chain(Penalties(frequency=0.5), TopK(40), MinP(0.05), Temperature(0.8), seed=7)`. Stages:
    `LogitBias`, `Penalties`, `DRY`, `Temperature`, `TopNSigma`, `TopK`, `TopP`, `MinP`, `Typical`,
    `XTC`, `Mirostat`, and `Greedy()` for the most likely token instead of a random draw (which
    the filters then do not narrow). The driver runs them in one fixed order whatever the order
    given: logit bias, penalties, DRY, the logit mask, temperature, top-n-sigma, top-k, top-p, min-p,
    typical, XTC, Mirostat, the draw; so `Chain(Temperature(t), TopK(k))` and `Chain(TopK(k), Temperature(t))` are
    the same sampler.
    Everything runs in the driver, batched over rows and pre-fired by the speculator like a
    plain sampler."""

    stages: tuple[object, ...]
    seed: int

    def __init__(self, *stages: object, seed: int = -1) -> None:
        need(seed, int, "Chain's seed")
        kinds = (LogitBias, Penalties, DRY, Temperature, TopK, TopP, MinP, Typical, TopNSigma, XTC, Mirostat, Greedy)
        for stage in stages:
            if not isinstance(stage, kinds):
                raise TypeError(f"a Chain stage is one of {', '.join(k.__name__ for k in kinds)}, not {stage!r}")
        for kind in kinds:
            if sum(isinstance(stage, kind) for stage in stages) > 1:
                raise ValueError(f"a Chain has at most one {kind.__name__}")
        object.__setattr__(self, "stages", tuple(stages))
        object.__setattr__(self, "seed", seed)
        # Their boundary forms, made once: a decode step with the chain only passes them on.
        object.__setattr__(self, "_wit", self._make_wit())
        object.__setattr__(self, "_wit_stages", self._make_stages())

    def _get(self, kind: type, default: object) -> object:
        return next((stage for stage in self.stages if isinstance(stage, kind)), default)

    def to_wit(self) -> _inf.Sampler:
        return self._wit  # type: ignore[attr-defined,no-any-return]

    def stages_to_wit(self) -> _Stages | None:
        return self._wit_stages  # type: ignore[attr-defined,no-any-return]

    def _make_wit(self) -> _inf.Sampler:
        if any(isinstance(stage, Greedy) for stage in self.stages):
            return Greedy().to_wit()
        return Random(
            temperature=self._get(Temperature, Temperature()).value,  # type: ignore[attr-defined]
            top_k=self._get(TopK, TopK(0)).value,  # type: ignore[attr-defined]
            top_p=self._get(TopP, TopP(1.0)).value,  # type: ignore[attr-defined]
            min_p=self._get(MinP, MinP(0.0)).value,  # type: ignore[attr-defined]
            seed=self.seed,
        ).to_wit()

    def _make_stages(self) -> _Stages | None:
        bias = self._get(LogitBias, None)
        penalties = self._get(Penalties, None)
        typical, sigma, xtc = self._get(Typical, None), self._get(TopNSigma, None), self._get(XTC, None)
        mirostat = self._get(Mirostat, None)
        filters = None
        if typical is not None or sigma is not None or xtc is not None or mirostat is not None:
            filters = _inf.Filters(
                typical.value if isinstance(typical, Typical) else 1.0,
                sigma.value if isinstance(sigma, TopNSigma) else 0.0,
                xtc.probability if isinstance(xtc, XTC) else 0.0,
                xtc.threshold if isinstance(xtc, XTC) else 0.1,
                mirostat.tau if isinstance(mirostat, Mirostat) else 0.0,
                mirostat.eta if isinstance(mirostat, Mirostat) else 0.1,
            )
        dry = self._get(DRY, None)
        if bias is None and penalties is None and filters is None and dry is None:
            return None
        pairs = sorted(bias.bias.items()) if isinstance(bias, LogitBias) else []
        wit_penalties = penalties.to_wit() if isinstance(penalties, Penalties) else None
        wit_dry = dry.to_wit() if isinstance(dry, DRY) else None
        return [(int(t), float(v)) for t, v in pairs], wit_penalties, filters, wit_dry


@dataclass(frozen=True)
class Temperature:
    value: float = 1.0

    def __post_init__(self) -> None:
        need(self.value, (float, int), "Temperature")
        if not self.value > 0:
            raise ValueError("Temperature must be positive (put Greedy() in the chain for temperature 0)")


@dataclass(frozen=True)
class TopK:
    value: int

    def __post_init__(self) -> None:
        need(self.value, int, "TopK")
        if self.value < 0:
            raise ValueError("TopK must be >= 0 (0: off)")


@dataclass(frozen=True)
class TopP:
    value: float

    def __post_init__(self) -> None:
        need(self.value, (float, int), "TopP")
        if not 0 < self.value <= 1:
            raise ValueError("TopP must be in (0, 1]")


@dataclass(frozen=True)
class MinP:
    value: float

    def __post_init__(self) -> None:
        need(self.value, (float, int), "MinP")
        if not 0 <= self.value < 1:
            raise ValueError("MinP must be in [0, 1)")


@dataclass(frozen=True)
class Typical:
    """Locally typical sampling: keep the tokens whose surprisal is nearest the distribution's
    entropy, until they hold `value` of the mass (llama.cpp's typical_p)."""

    value: float

    def __post_init__(self) -> None:
        need(self.value, (float, int), "Typical")
        if not 0 < self.value <= 1:
            raise ValueError("Typical must be in (0, 1]")


@dataclass(frozen=True)
class TopNSigma:
    """Keep the tokens whose logit is within `value` standard deviations of the best."""

    value: float

    def __post_init__(self) -> None:
        need(self.value, (float, int), "TopNSigma")
        if not 0 <= self.value < float("inf"):
            raise ValueError("TopNSigma must be >= 0 (0: off)")


@dataclass(frozen=True)
class XTC:
    """Exclude the top choices: with `probability`, remove every token at least `threshold`
    likely but the least likely of them, when there are two or more."""

    probability: float
    threshold: float = 0.1

    def __post_init__(self) -> None:
        need(self.probability, (float, int), "XTC's probability")
        need(self.threshold, (float, int), "XTC's threshold")
        if not (0 <= self.probability <= 1 and 0 <= self.threshold <= 1):
            raise ValueError("XTC's probability and threshold must be in [0, 1]")


@dataclass(frozen=True)
class Mirostat:
    """Mirostat 2: keep the tokens whose surprise (bits) is within mu, a running target the
    driver keeps with the context (it follows forks and rollbacks) and moves toward `tau` by
    `eta` times each drawn token's miss. Starts at 2 * tau."""

    tau: float = 5.0
    eta: float = 0.1

    def __post_init__(self) -> None:
        need(self.tau, (float, int), "Mirostat's tau")
        need(self.eta, (float, int), "Mirostat's eta")
        if not (0 < self.tau < float("inf") and 0 <= self.eta <= 1):
            raise ValueError("Mirostat needs tau > 0 and eta in [0, 1]")


Sampler = Greedy | Random | Chain


def output(fp: _inf.ForwardPass, row: int, sampler: Sampler, probe: _inf.Probe, k: int) -> None:
    """Ask `fp` for an output on `row` sampled by `sampler` (with a chain's stages)."""
    fp.output(row, sampler.to_wit(), probe, k)
    stages = sampler.stages_to_wit() if isinstance(sampler, Chain) else None
    if stages is not None:
        fp.sampler_stages(row, *stages)
