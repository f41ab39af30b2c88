"""The Prometheus text the registry renders."""

from __future__ import annotations

from host.daemon.metrics import Counter, Histogram, Registry, SampledFamily


def test_render() -> None:
    registry = Registry()
    counter = Counter("wafer_x_total", "X.", ("kind",))
    counter.inc(2, 'a"b')
    histogram = Histogram("wafer_latency_seconds", "Latency.", ("route",), buckets=(0.1, 1.0))
    histogram.observe(0.05, "/v1")
    histogram.observe(5.0, "/v1")
    registry.add(counter)
    registry.add(histogram)
    registry.add(SampledFamily("wafer_up", "Up.", "gauge", (), lambda: {(): 1.0}))
    text = registry.render()
    assert '# TYPE wafer_x_total counter\nwafer_x_total{kind="a\\"b"} 2\n' in text
    assert 'wafer_latency_seconds_bucket{route="/v1",le="0.1"} 1' in text
    assert 'wafer_latency_seconds_bucket{route="/v1",le="1"} 1' in text
    assert 'wafer_latency_seconds_bucket{route="/v1",le="+Inf"} 2' in text
    assert 'wafer_latency_seconds_count{route="/v1"} 2' in text
    assert "wafer_up 1\n" in text
