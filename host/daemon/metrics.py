"""A tiny Prometheus registry: labelled counters and histograms updated by the daemon, plus
gauges sampled at scrape time; rendered in the Prometheus text exposition format (0.0.4).

It knows the format, not what is measured (see `ops.py`).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

LabelValues = tuple[str, ...]

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(label_names)
        self._lock = threading.Lock()
        self._values: dict[LabelValues, float] = {}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        with self._lock:
            items = sorted(self._values.items())
        for labels, value in items:
            yield f"{self.name}{_labels(self.label_names, labels)} {_number(value)}"


class Histogram:
    def __init__(
        self, name: str, help_text: str, label_names: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS_S
    ) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(label_names)
        self._buckets = tuple(sorted(buckets))
        self._lock = threading.Lock()
        self._series: dict[LabelValues, tuple[list[int], list[float]]] = {}  # counts per bucket, [sum]

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            counts, total = self._series.setdefault(labels, ([0] * (len(self._buckets) + 1), [0.0]))
            counts[bisect.bisect_left(self._buckets, value)] += 1
            total[0] += value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        with self._lock:
            items = sorted((k, (list(c), t[0])) for k, (c, t) in self._series.items())
        for labels, (counts, total) in items:
            cumulative = 0
            for bound, count in zip((*self._buckets, math.inf), counts, strict=True):
                cumulative += count
                le = f'le="{_number(bound)}"'
                yield f"{self.name}_bucket{_labels(self.label_names, labels, le)} {cumulative}"
            yield f"{self.name}_sum{_labels(self.label_names, labels)} {_number(total)}"
            yield f"{self.name}_count{_labels(self.label_names, labels)} {cumulative}"


class SampledFamily:
    """Gauges or counters whose values are read at scrape time (from the engine, the driver)."""

    def __init__(
        self,
        name: str,
        help_text: str,
        kind: str,
        label_names: Sequence[str],
        sample: Callable[[], Mapping[LabelValues, float]],
    ) -> None:
        self.name, self.help, self.kind, self.label_names, self._sample = (
            name,
            help_text,
            kind,
            tuple(label_names),
            sample,
        )

    def render(self) -> Iterable[str]:
        values = self._sample()
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for labels, value in sorted(values.items()):
            yield f"{self.name}{_labels(self.label_names, labels)} {_number(value)}"


Family = Counter | Histogram | SampledFamily


class Registry:
    def __init__(self) -> None:
        self._families: list[Family] = []

    def add(self, family: Family) -> None:
        self._families.append(family)

    def render(self) -> str:
        lines: list[str] = []
        for family in self._families:
            lines.extend(family.render())
        return "\n".join(lines) + "\n"
