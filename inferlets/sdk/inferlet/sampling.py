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


Sampler = Greedy | Random
