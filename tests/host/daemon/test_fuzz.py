"""Schema-driven fuzzing of the served OpenAPI document (schemathesis, bounded in time): no input
may produce a 5xx. Skipped where schemathesis is not installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.host.daemon.conftest import API_KEY, Server

FUZZ_SECONDS = 20


def test_no_server_errors(server: Server, tmp_path: Path) -> None:
    pytest.importorskip("schemathesis")
    cli = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    if not Path(cli).exists():
        pytest.skip("the schemathesis command is not installed")
    proc = subprocess.run(
        [
            cli, "run", f"{server.url}/openapi.json",
            "--checks", "not_a_server_error",
            "--header", f"Authorization: Bearer {API_KEY}",
            "--max-examples", "10",
            "--max-time", str(FUZZ_SECONDS),
            "--request-timeout", "60",
            "--seed", "1",
        ],
        capture_output=True, text=True, timeout=FUZZ_SECONDS * 6, check=False,
        cwd=tmp_path,  # schemathesis keeps its state in the working directory
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    # Leave no fuzzed run behind for the tests that follow.
    with server.http() as http:
        for run in http.get("/v1/runs").json()["data"]:
            if run["state"] == "running":
                http.post(f"/v1/runs/{run['id']}/cancel")
    server.wait_ready()
