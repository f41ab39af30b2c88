"""A model the driver cannot load: the driver says so in one line naming the file, the daemon
keeps serving HTTP and does not restart it in a loop (a restart cannot fix a file), /health and
every request that needs the model say why, and `wafer serve MODEL` implies the torch driver."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from host.daemon.config import load_config
from tests.host.daemon.conftest import API_KEY, Server, _free_port, serving

MESSAGES = [{"role": "user", "content": "Hello"}]


def _daemon_config(tmp_path: Path, **keys: object) -> dict[str, object]:
    return {
        "host": "127.0.0.1",
        "port": _free_port(),
        "api_keys": [API_KEY],
        "restart_backoff_initial_s": 0.05,
        "data_dir": str(tmp_path / "data"),
        "log_level": "warning",
        **keys,
    }


def _failed_health(srv: Server, timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    with srv.http() as http:
        while True:
            response = http.get("/health")
            body: dict[str, object] = response.json()
            driver = body["driver"]
            assert isinstance(driver, dict)
            if driver["state"] == "failed":
                assert response.status_code == 503 and body["status"] == "unavailable"
                return driver
            assert time.monotonic() < deadline, f"the driver did not fail: {body}"
            time.sleep(0.05)


@pytest.mark.parametrize("contents", [b"GGUF\x03\x00\x00\x00garbage", b"not a model at all" * 100])
def test_a_malformed_gguf_fails_once_with_one_line(tmp_path: Path, contents: bytes) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(contents)
    # No driver named: the model implies the torch driver.
    config = load_config(_daemon_config(tmp_path, model=str(bad)), environ={})
    assert config.replica_drivers == ("torch",)
    with serving(config, Path("unused"), wait_ready=False) as srv:
        driver = _failed_health(srv, timeout_s=120)
        error = str(driver["last_error"])
        assert f"{bad} is not a readable GGUF file" in error and "Traceback" not in error, error
        time.sleep(1.0)  # several backoffs' worth: nothing restarts it
        with srv.http() as http:
            again = http.get("/health").json()["driver"]
            assert again["restarts"] == 0 and again["pid"] is None and again["state"] == "failed"
            response = http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
            assert response.status_code == 503 and "broken.gguf is not a readable GGUF file" in response.text


def test_a_driver_refusing_its_arguments_is_not_restarted(tmp_path: Path) -> None:
    config = load_config(_daemon_config(tmp_path, driver="dummy --no-such-option"), environ={})
    with serving(config, Path("unused"), wait_ready=False) as srv:
        driver = _failed_health(srv, timeout_s=60)
        assert "--no-such-option" in str(driver["last_error"]) and driver["restarts"] == 0


def test_a_missing_model_is_named(tmp_path: Path) -> None:
    config = load_config(_daemon_config(tmp_path, model=str(tmp_path / "nowhere.gguf")), environ={})
    with serving(config, Path("unused"), wait_ready=False) as srv:
        driver = _failed_health(srv, timeout_s=120)
        assert f"{tmp_path / 'nowhere.gguf'}: no such file or directory" in str(driver["last_error"])
