"""[limits]' acceptance through the daemon: each hostile run of the `misbehave` test inferlet
ends at its limit (or at cancel), and while it runs and after it ends a `/health` probe answers
and a chat completion succeeds, for every other tenant."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import pytest

from host.build import build
from tests.host.daemon.conftest import Server
from tests.host.daemon.sse import events

MISBEHAVE = Path(__file__).resolve().parents[1] / "sandbox" / "inferlets" / "misbehave"
MESSAGES = [{"role": "user", "content": "Still there?"}]

# (misbehave's args, the run's end state, words its error has); None: it runs until cancelled.
ATTACKS: list[tuple[list[str], str | None, str]] = [
    (["sleep", "3600"], "failed", "sleep"),  # refused at once, not asleep for an hour
    (["flood", "emit", "forever"], "failed", "output limit exceeded"),
    (["flood", "send", "forever"], "failed", "output limit exceeded"),
    # complete_flood (host-side generation streaming without end) is covered in the sandbox's
    # tests: here its one byte per generated token would take minutes to reach the output limit.
    (["alloc"], "failed", "memory"),
    (["buffer_inputs", "tokens", "forever"], "failed", "memory"),
    (["panic"], "failed", "surrogates not allowed"),
    (["decode_forever"], None, ""),
    (["wait"], None, ""),
]


@pytest.fixture(scope="module")
def misbehave_id(server: Server) -> str:
    data = build(str(MISBEHAVE), server.config.cache_dir).wasm_path.read_bytes()
    with server.http() as http:
        response = http.post("/v1/inferlets", content=data)
        assert response.status_code in (200, 201), response.text
        return str(response.json()["id"])


def _others_are_served(server: Server, http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    resp = server.client().chat.completions.create(model="dummy", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("args", "state", "words"), ATTACKS, ids=["-".join(a[0][:2]) for a in ATTACKS])
def test_an_attack_ends_at_its_limit_and_the_daemon_serves_others_throughout(
    server: Server, misbehave_id: str, args: list[str], state: str | None, words: str
) -> None:
    with server.http() as http:
        started = http.post("/v1/runs", json={"inferlet": misbehave_id, "args": args})
        assert started.status_code == 201, started.text
        run_id = started.json()["id"]
        _others_are_served(server, http)  # during
        if state is None:  # it would run on: cancel ends it
            assert http.post(f"/v1/runs/{run_id}/cancel").status_code in (200, 202)
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            seen = list(events(response))
        name, end = seen[-1]
        assert name == "end" and end["state"] == (state or "cancelled"), end
        assert words.lower() in (end.get("error") or "").lower(), end
        _others_are_served(server, http)  # after
