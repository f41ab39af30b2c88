"""The daemon's Prometheus metrics, on prometheus_client: counters and histograms the daemon
updates as requests go, and families sampled at scrape time from the engine and the driver
(`SampledFamily`). It knows the plumbing, not what is measured (host.daemon.daemon)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LabelValues = tuple[str, ...]

# Request latencies (HTTP, first token, end to end, queue), seconds.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Time per output token: a CPU step is milliseconds to a few hundred.
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# `_created` series double every counter and histogram; dashboards do not read them.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


class SampledFamily(Collector):
    """Gauges or counters whose values are read at scrape time (from the engine, the driver):
    `sample()` maps label values to a value. A counter's name ends in `_total`."""

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
            list(label_names),
            sample,
        )

    def collect(self) -> Iterator[Metric]:
        family: GaugeMetricFamily | CounterMetricFamily
        if self.kind == "counter":
            family = CounterMetricFamily(self.name.removesuffix("_total"), self.help, labels=self.label_names)
        else:
            family = GaugeMetricFamily(self.name, self.help, labels=self.label_names)
        for labels, value in sorted(self._sample().items()):
            family.add_metric(list(labels), value)
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())  # sampled at scrape time: nothing to check at registration


class BoundedCounts:
    """Counts by (name, outcome) for a counter family whose names are not known in advance (an
    uploaded inferlet's id): the first `max_names` names get their own series, later ones count
    as "other", so no client can grow the family without bound. Not locked: its owner locks."""

    OTHER = "other"

    def __init__(self, max_names: int) -> None:
        self._max_names = max_names
        self._names: set[str] = set()
        self._counts: dict[LabelValues, int] = {}

    def add(self, name: str, outcome: str) -> None:
        if name not in self._names and len(self._names) < self._max_names:
            self._names.add(name)
        key = (name if name in self._names else self.OTHER, outcome)
        self._counts[key] = self._counts.get(key, 0) + 1

    def counts(self) -> dict[LabelValues, int]:
        return dict(self._counts)


class Registry:
    """The daemon's own registry (not prometheus_client's global one: tests start several
    daemons in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> Counter:
        return Counter(name.removesuffix("_total"), help_text, label_names, registry=self.registry)

    def gauge(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> Gauge:
        return Gauge(name, help_text, label_names, registry=self.registry)

    def histogram(
        self, name: str, help_text: str, label_names: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS_S
    ) -> Histogram:
        return Histogram(name, help_text, label_names, buckets=buckets, registry=self.registry)

    def add(self, family: SampledFamily) -> None:
        self.registry.register(family)

    def render(self) -> str:
        """The Prometheus text exposition format."""
        return prometheus_client.generate_latest(self.registry).decode()
