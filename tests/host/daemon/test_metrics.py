"""The Prometheus text the daemon's registry renders (prometheus_client underneath)."""

from __future__ import annotations

from host.daemon.metrics import Registry, SampledFamily


def test_render() -> None:
    registry = Registry()
    registry.counter("wafer_x_total", "X.", ("kind",)).labels('a"b').inc(2)
    histogram = registry.histogram("wafer_latency_seconds", "Latency.", ("route",), buckets=(0.1, 1.0))
    histogram.labels("/v1").observe(0.05)
    histogram.labels("/v1").observe(5.0)
    registry.add(SampledFamily("wafer_up", "Up.", "gauge", (), lambda: {(): 1.0}))
    registry.add(SampledFamily("wafer_ends_total", "Ends.", "counter", ("state",), lambda: {("ok",): 3.0}))
    text = registry.render()
    assert '# TYPE wafer_x_total counter\nwafer_x_total{kind="a\\"b"} 2.0\n' in text
    assert 'wafer_latency_seconds_bucket{le="0.1",route="/v1"} 1.0' in text
    assert 'wafer_latency_seconds_bucket{le="1.0",route="/v1"} 1.0' in text
    assert 'wafer_latency_seconds_bucket{le="+Inf",route="/v1"} 2.0' in text
    assert 'wafer_latency_seconds_count{route="/v1"} 2.0' in text
    assert "wafer_up 1.0\n" in text
    assert 'wafer_ends_total{state="ok"} 3.0\n' in text
    assert "_created" not in text  # not doubled by creation timestamps


def test_two_registries_do_not_share_metrics() -> None:
    """Tests start several daemons in one process: each has its own names."""
    first, second = Registry(), Registry()
    first.counter("wafer_same_total", "Same.").inc()
    second.counter("wafer_same_total", "Same.")
    assert "wafer_same_total 1.0" in first.render() and "wafer_same_total 0.0" in second.render()
