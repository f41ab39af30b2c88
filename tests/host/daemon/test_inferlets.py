"""Inferlet endpoints: upload (key required, size-limited, named by content hash), runs with
args, their SSE stream, messages to them, cancel, and the list of runs with their states."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from host.daemon.errors import BadRequest
from host.daemon.inferlet_store import InferletStore
from host.sandbox import Sandbox, SandboxConfig
from host.sandbox.config import MIB
from tests.host.daemon.conftest import OTHER_KEY, Server
from tests.host.daemon.sse import events


@pytest.fixture(scope="module")
def echo_id(server: Server) -> str:
    data = server.echo_wasm.read_bytes()
    with server.http() as http:
        response = http.post("/v1/inferlets", content=data, headers={"content-type": "application/wasm"})
        assert response.status_code in (200, 201), response.text
        body = response.json()
    assert body["id"] == f"sha256:{hashlib.sha256(data).hexdigest()}"
    assert body["bytes"] == len(data)
    return str(body["id"])


def test_upload_is_idempotent_and_listed(server: Server, echo_id: str) -> None:
    with server.http() as http:
        again = http.post("/v1/inferlets", content=server.echo_wasm.read_bytes())
        assert again.status_code == 200 and again.json()["id"] == echo_id
        assert echo_id in [e["id"] for e in http.get("/v1/inferlets").json()["data"]]
        assert http.get(f"/v1/inferlets/{echo_id}").json()["id"] == echo_id
        assert http.get(f"/v1/inferlets/sha256:{'0' * 64}").status_code == 404
        assert http.get("/v1/inferlets/latest").status_code == 400


def test_uploads_are_scoped_to_their_key_unless_shared(server: Server, echo_id: str) -> None:
    with server.http(key=OTHER_KEY) as other, server.http() as mine:
        # Another key's upload does not exist for this one: not listed, not found, not runnable.
        assert echo_id not in [e["id"] for e in other.get("/v1/inferlets").json()["data"]]
        assert other.get(f"/v1/inferlets/{echo_id}").status_code == 404
        refused = other.post("/v1/runs", json={"inferlet": echo_id, "args": ["echo"]})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "inferlet_not_found"
        # Uploading the same bytes gives this key its own right to it (new to it: 201).
        uploaded = other.post("/v1/inferlets", content=server.echo_wasm.read_bytes())
        assert uploaded.status_code == 201 and uploaded.json() == {**uploaded.json(), "id": echo_id, "shared": False}
        assert other.get(f"/v1/inferlets/{echo_id}").status_code == 200
        # An explicit share makes it every key's; it stays shared.
        shared = other.post("/v1/inferlets", params={"shared": "true"}, content=server.echo_wasm.read_bytes())
        assert shared.status_code == 200 and shared.json()["shared"] is True
        assert mine.get(f"/v1/inferlets/{echo_id}").json()["shared"] is True


def test_upload_refusals(server: Server) -> None:
    with server.http(key=None) as http:
        assert http.post("/v1/inferlets", content=b"\0asm").status_code == 401
        assert http.post("/v1/runs", json={"inferlet": "chat"}).status_code == 401
        assert http.get("/v1/runs").status_code == 401
    with server.http() as http:
        response = http.post("/v1/inferlets", content=b"not a component")
        message = response.json()["error"]["message"]
        assert response.status_code == 400 and "component" in message
        # Never the server's paths or pid: the data directory, a temporary file's name.
        assert str(server.config.data_dir) not in message and ".tmp" not in message and "the upload" in message
        assert http.post("/v1/inferlets", content=b"").status_code == 400
        too_big = b"\0" * (server.config.max_upload_bytes + 1)
        assert http.post("/v1/inferlets", content=too_big).status_code == 413


def test_run_with_messages(server: Server, echo_id: str) -> None:
    with server.http() as http:
        started = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["echo"]})
        assert started.status_code == 201, started.text
        run = started.json()
        assert run["state"] == "running" and run["inferlet"] == echo_id
        run_id = run["id"]
        assert http.post(f"/v1/runs/{run_id}/messages", json={"message": "one"}).status_code == 200
        assert http.post(f"/v1/runs/{run_id}/messages", json={"message": "two", "close": True}).status_code == 200
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            seen = list(events(response))
        outputs = "".join(data["text"] for name, data in seen if name == "output")
        assert outputs == "echo: one\necho: two\n"
        messages = [json.loads(data["message"]) for name, data in seen if name == "message"]
        assert messages == [{"received": 2}]
        assert seen[-1][0] == "end" and seen[-1][1]["state"] == "succeeded"
        assert http.get(f"/v1/runs/{run_id}").json()["state"] == "succeeded"
        assert http.post(f"/v1/runs/{run_id}/messages", json={"message": "late"}).status_code == 400
        # Replay from a later point: only what came after.
        last_seq = seen[-2][1]["seq"]
        with http.stream("GET", f"/v1/runs/{run_id}/events", params={"after": last_seq}) as response:
            assert [name for name, _ in events(response)] == ["end"]


def test_run_fails_cleanly(server: Server, echo_id: str) -> None:
    with server.http() as http:
        run_id = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["no-such-mode"]}).json()["id"]
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            end = next(data for name, data in events(response) if name == "end")
        assert end["state"] == "failed" and "no-such-mode" in end["error"]


def test_cancel_and_list(server: Server, echo_id: str) -> None:
    with server.http() as http:
        run_id = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["decode"]}).json()["id"]
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            for name, _data in events(response):
                if name == "output":  # it is decoding: now cancel it
                    break
        listed = {r["id"]: r for r in http.get("/v1/runs", params={"kind": "inferlet"}).json()["data"]}
        assert listed[run_id]["state"] == "running"
        cancelled = http.post(f"/v1/runs/{run_id}/cancel").json()
        assert cancelled["state"] == "cancelled"
        listed = {r["id"]: r for r in http.get("/v1/runs").json()["data"]}
        assert listed[run_id]["state"] == "cancelled"
        assert http.get("/v1/runs/999999").status_code == 404
        assert http.get("/v1/runs", params={"kind": "nope"}).status_code == 400


def test_an_output_flood_ends_the_run_at_its_limit(server: Server, echo_id: str) -> None:
    with server.http() as http:
        run_id = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["flood"]}).json()["id"]
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            seen = list(events(response))
        end = seen[-1][1]
        assert seen[-1][0] == "end" and end["state"] == "failed"
        assert "output limit exceeded" in end["error"] and "run_max_output_mib" in end["error"]
        assert sum(len(data["text"]) for name, data in seen if name == "output") == 4 * 1024 * 1024
        assert http.get("/health").json()["status"] == "ok"  # and the daemon keeps serving


def test_messages_to_a_run_that_never_receives_are_bounded(server: Server, echo_id: str) -> None:
    with server.http() as http:
        run_id = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["decode"]}).json()["id"]
        message = "m" * (60 * 1024)  # under the request limit; 17 of them fill the 1 MiB inbox
        codes = [http.post(f"/v1/runs/{run_id}/messages", json={"message": message}).status_code for _ in range(17)]
        assert codes == [200] * 17
        refused = http.post(f"/v1/runs/{run_id}/messages", json={"message": message})
        assert refused.status_code == 413
        error = refused.json()["error"]
        assert error["code"] == "inbox_full" and "run_max_inbound_mib" in error["message"]
        assert http.get(f"/v1/runs/{run_id}").json()["state"] == "running"  # the run goes on
        assert http.post(f"/v1/runs/{run_id}/cancel").json()["state"] == "cancelled"


def test_start_refusals(server: Server) -> None:
    with server.http() as http:
        assert http.post("/v1/runs", json={"inferlet": f"sha256:{'1' * 64}"}).status_code == 404
        assert http.post("/v1/runs", json={"inferlet": "chat", "args": "x"}).status_code == 400
        assert http.post("/v1/runs", json={"args": []}).status_code == 400


def test_builtin_chat_runs_directly(server: Server) -> None:
    request = {"prompts": [{"text": "hi"}], "max_tokens": 3, "temperature": 0}
    with server.http() as http:
        run_id = http.post("/v1/runs", json={"inferlet": "chat", "args": [json.dumps(request)]}).json()["id"]
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            seen = list(events(response))
    messages = [json.loads(data["message"]) for name, data in seen if name == "message"]
    assert messages[0] == {"prompt_tokens": [2]}
    assert seen[-1][1]["state"] == "succeeded"


def test_runs_belong_to_their_key(server: Server, echo_id: str) -> None:
    with server.http() as http, server.http(OTHER_KEY) as other:
        run_id = http.post("/v1/runs", json={"inferlet": echo_id, "args": ["echo"]}).json()["id"]
        assert other.get(f"/v1/runs/{run_id}").status_code == 404
        assert other.post(f"/v1/runs/{run_id}/messages", json={"message": "x"}).status_code == 404
        assert other.post(f"/v1/runs/{run_id}/cancel").status_code == 404
        assert other.get(f"/v1/runs/{run_id}/events").status_code == 404
        assert run_id not in [r["id"] for r in other.get("/v1/runs").json()["data"]]
        assert http.get(f"/v1/runs/{run_id}").json()["state"] == "running"
        http.post(f"/v1/runs/{run_id}/messages", json={"close": True})
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            assert list(events(response))[-1][1]["state"] == "succeeded"


def test_an_upload_too_costly_to_compile_is_refused_naming_the_budget(server: Server, tmp_path: Path) -> None:
    """The compile runs in a child whose memory is capped (component_compile_mib): past it the
    upload is a clear refusal, nothing is stored, and the server's path is never shown."""
    with Sandbox(SandboxConfig(cache_dir=tmp_path / "cache", compile_memory_bytes=100 * MIB)) as sandbox:
        store = InferletStore(tmp_path / "store", sandbox)
        with pytest.raises(BadRequest, match=r"needs more than 100 MiB \(component_compile_mib\)") as info:
            store.add(server.echo_wasm.read_bytes())
        assert str(tmp_path) not in str(info.value) and store.list() == []
    with server.http() as http:  # the server itself keeps serving
        assert http.get("/health").status_code == 200


def test_uploads_stored_whole_before_records_are_taken_into_the_store(server: Server, tmp_path: Path) -> None:
    """A data directory from before records (`<hex>.wasm`, an access list beside it or none)
    keeps its uploads: each is split into component and sources, with the same owners."""
    echo = server.echo_wasm.read_bytes()
    tiny = b"\0asm\x0d\x00\x01\x00"
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    ids = {}
    for name, data, acl in (("echo", echo, {"owners": ["k1"], "shared": False}), ("tiny", tiny, None)):
        hex_id = hashlib.sha256(data).hexdigest()
        (store_dir / f"{hex_id}.wasm").write_bytes(data)
        if acl is not None:
            (store_dir / f"{hex_id}.acl.json").write_text(json.dumps(acl))
        ids[name] = f"sha256:{hex_id}"
    with Sandbox(SandboxConfig(cache_dir=server.config.cache_dir)) as sandbox:
        store = InferletStore(store_dir, sandbox)
        assert [e.id for e in store.list("k1")] == sorted(ids.values())
        assert [e.id for e in store.list("k2")] == [ids["tiny"]]  # one with no access list is every key's
        assert store.get(ids["echo"], "k1").size_bytes == len(echo)
        loaded = store.load(ids["echo"], "k1")
        assert loaded.app is not None and any(path == "app.py" for path, _ in loaded.app.files)
    assert not list(store_dir.glob("*.wasm")) and not list(store_dir.glob("*.acl.json"))
