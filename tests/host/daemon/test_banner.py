"""The banner `wafer serve` prints: a URL and examples, never a key."""

from __future__ import annotations

from host.daemon.banner import banner


def test_banner_never_prints_keys() -> None:
    text = banner("http://127.0.0.1:8000", "dummy", has_keys=True)
    assert "http://127.0.0.1:8000/v1/chat/completions" in text and '"model": "dummy"' in text
    assert "Bearer $KEY" in text
    assert "Authorization" not in banner("http://127.0.0.1:8000", "dummy", has_keys=False)
