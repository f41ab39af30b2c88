"""What the daemon keeps for its tenants, through its HTTP API, on a daemon with small limits and
many keys (each test its own): finished runs by count and by bytes, per key and in all; error
text cut to its bound; list pages; the per-key upload quota; delete; uploads of bytes another key
has; malformed sources; an inferlet's sources held once while runs use them, and not after."""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from host.app_bundle import SECTION_NAME, AppSources, _leb128, append_sources, split_sources
from host.daemon.run_log import MAX_ERROR_BYTES
from host.sandbox.compile_cache import cache_key
from tests.host.daemon.conftest import Server, _free_port, serving
from tests.host.daemon.sse import events

KEYS = [f"tenant-{i}" for i in range(24)]
EMPTY_COMPONENT = b"\0asm\x0d\x00\x01\x00"


def _custom_section(name: bytes, payload: bytes) -> bytes:
    body = _leb128(len(name)) + name + payload
    return bytes([0]) + _leb128(len(body)) + body


def tiny(tag: str, pad_bytes: int = 0) -> bytes:
    """A component that does nothing, made distinct by a custom section (compiles in a moment)."""
    return EMPTY_COMPONENT + _custom_section(b"pad", tag.encode() + b"." * pad_bytes)


def echo_variant(echo: bytes, tag: str, extra: str = "") -> bytes:
    """The echo inferlet with one more source file: other bytes, the same compiled base."""
    base, app = split_sources(echo)
    assert app is not None
    files = (*app.files, (f"pad_{tag}.py", f"# {tag}\n{extra}"))
    return append_sources(base, AppSources(app.base_digest, files))


@pytest.fixture(scope="module")
def limited(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    echo_bytes = server.echo_wasm.stat().st_size
    config = dataclasses.replace(
        server.config,
        port=_free_port(),
        data_dir=tmp_path_factory.mktemp("limits-data"),
        api_keys=tuple(KEYS),
        run_max_output_mib=1,  # one `flood` run keeps a little over 1 MiB
        key_max_kept_runs=3,
        max_kept_runs=4,
        key_max_kept_run_mib=2,  # one flood run's worth, not two
        max_kept_run_mib=3,  # two flood runs' worth, not three
        key_max_uploads=3,
        key_max_upload_bytes=int(2.5 * echo_bytes),
    )
    with serving(config, server.echo_wasm) as srv:
        yield srv


def _upload(http: httpx.Client, data: bytes, **params: Any) -> httpx.Response:
    return http.post("/v1/inferlets", content=data, params=params)


def _echo_id(srv: Server, http: httpx.Client) -> str:
    response = _upload(http, srv.echo_wasm.read_bytes())
    assert response.status_code in (200, 201), response.text
    return str(response.json()["id"])


def _run_to_end(http: httpx.Client, inferlet_id: str, args: list[str]) -> tuple[int, dict[str, Any]]:
    started = http.post("/v1/runs", json={"inferlet": inferlet_id, "args": args})
    assert started.status_code == 201, started.text
    run_id = int(started.json()["id"])
    with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
        name, end = list(events(response))[-1]
    assert name == "end", end
    return run_id, end


def _failed_run(http: httpx.Client, inferlet_id: str) -> int:
    run_id, end = _run_to_end(http, inferlet_id, ["no-such-mode"])
    assert end["state"] == "failed"
    return run_id


def _flood_run(http: httpx.Client, inferlet_id: str) -> int:
    run_id, end = _run_to_end(http, inferlet_id, ["flood"])
    assert end["state"] == "failed" and "output limit exceeded" in end["error"], end
    return run_id


def _all_pages(http: httpx.Client, path: str, limit: int) -> list[dict[str, Any]]:
    """Every item, page by page; each page checked against the cursor's rules."""
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": limit}
    while True:
        page = http.get(path, params=params)
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["data"]) <= limit
        items += body["data"]
        if not body["has_more"]:
            return items
        assert len(body["data"]) == limit and body["last_id"] == body["data"][-1]["id"]
        params["after"] = body["last_id"]


def _kept_run_ids(http: httpx.Client) -> set[int]:
    return {r["id"] for r in _all_pages(http, "/v1/runs", 1000)}


# ---------------------------------------------------------------------- finished runs


def test_a_key_keeps_its_last_runs_by_count_and_another_keys_are_untouched(limited: Server) -> None:
    with limited.http(KEYS[0]) as a, limited.http(KEYS[1]) as b:
        theirs = _failed_run(b, _echo_id(limited, b))
        echo = _echo_id(limited, a)
        mine = [_failed_run(a, echo) for _ in range(4)]
        # key_max_kept_runs is 3: the key's first run is forgotten, not the other key's older one.
        assert _kept_run_ids(a) == set(mine[1:])
        assert a.get(f"/v1/runs/{mine[0]}").status_code == 404
        assert _kept_run_ids(b) == {theirs}


def test_all_keys_together_keep_the_last_runs_by_count(limited: Server) -> None:
    with limited.http(KEYS[2]) as a, limited.http(KEYS[3]) as b, limited.http(KEYS[4]) as c:
        ids = {http: _echo_id(limited, http) for http in (a, b, c)}
        runs = [_failed_run(http, ids[http]) for http in (a, a, b, b, c)]
        # max_kept_runs is 4: the oldest run of all is forgotten, though its key kept under its own bound.
        assert _kept_run_ids(a) == {runs[1]}
        assert _kept_run_ids(b) == set(runs[2:4]) and _kept_run_ids(c) == {runs[4]}


def test_a_key_keeps_its_last_runs_by_bytes(limited: Server) -> None:
    with limited.http(KEYS[5]) as a, limited.http(KEYS[6]) as b:
        theirs = _failed_run(b, _echo_id(limited, b))
        echo = _echo_id(limited, a)
        first, second = _flood_run(a, echo), _flood_run(a, echo)
        # Each flood run keeps its 1 MiB of output: two pass key_max_kept_run_mib (2), all three runs
        # are under max_kept_run_mib (3) and the count bounds.
        assert _kept_run_ids(a) == {second} and a.get(f"/v1/runs/{first}").status_code == 404
        assert _kept_run_ids(b) == {theirs}


def test_all_keys_together_keep_the_last_runs_by_bytes(limited: Server) -> None:
    with limited.http(KEYS[7]) as a, limited.http(KEYS[8]) as b, limited.http(KEYS[9]) as c:
        runs = [_flood_run(http, _echo_id(limited, http)) for http in (a, b, c)]
        # Three flood runs pass max_kept_run_mib (3), though each key keeps one under its own bound.
        assert _kept_run_ids(a) == set() and a.get(f"/v1/runs/{runs[0]}").status_code == 404
        assert _kept_run_ids(b) == {runs[1]} and _kept_run_ids(c) == {runs[2]}
        with b.stream("GET", f"/v1/runs/{runs[1]}/events") as response:  # its output is still there
            seen = list(events(response))
        assert sum(len(data["text"]) for name, data in seen if name == "output") == 1 << 20


def test_a_long_error_is_cut_to_its_bound_where_it_is_kept_and_logged(
    limited: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="wafer.daemon.runs")
    with limited.http(KEYS[10]) as http:
        mode = "m" * 40_000  # the echo inferlet raises ValueError naming its unknown mode
        run_id, end = _run_to_end(http, _echo_id(limited, http), [mode])
        kept = [end["error"], http.get(f"/v1/runs/{run_id}").json()["error"]]
        kept += [r["error"] for r in _all_pages(http, "/v1/runs", 1000) if r["id"] == run_id]
    assert len(kept) == 3
    for error in kept:
        assert "ValueError: unknown mode 'mmm" in error
        head, _, more = error.rpartition("... (")
        assert len(head.encode()) <= MAX_ERROR_BYTES and more.endswith(" bytes more)"), error[-80:]
        assert int(more.split()[0]) > 40_000 - MAX_ERROR_BYTES
    logged = [r.getMessage() for r in caplog.records if f"run {run_id} ended" in r.getMessage()]
    assert len(logged) == 1 and len(logged[0]) < MAX_ERROR_BYTES + 200 and "bytes more)" in logged[0]


# ---------------------------------------------------------------------- list pages


def test_runs_are_listed_a_page_at_a_time(limited: Server) -> None:
    with limited.http(KEYS[11]) as http, limited.http(KEYS[12]) as other:
        echo = _echo_id(limited, http)
        ids = [http.post("/v1/runs", json={"inferlet": echo, "args": ["echo"]}).json()["id"] for _ in range(3)]
        try:
            first = http.get("/v1/runs", params={"limit": 2}).json()
            assert [r["id"] for r in first["data"]] == ids[:2] and first["has_more"] is True
            assert (first["first_id"], first["last_id"]) == (ids[0], ids[1])
            rest = http.get("/v1/runs", params={"limit": 2, "after": first["last_id"]}).json()
            assert [r["id"] for r in rest["data"]] == ids[2:] and rest["has_more"] is False
            assert all("output" not in r for r in first["data"])  # output is read from a run's events
            assert http.get("/v1/runs").json()["data"] == [*first["data"], *rest["data"]]  # default limit: 100
            assert other.get("/v1/runs", params={"limit": 1}).json() == {
                "object": "list",
                "data": [],
                "first_id": None,
                "last_id": None,
                "has_more": False,
            }
            for params in ({"limit": 0}, {"limit": 1001}, {"after": -1}):
                refused = http.get("/v1/runs", params=params)
                assert refused.status_code == 400 and refused.json()["error"]["param"] in params, refused.text
        finally:
            for run_id in ids:
                http.post(f"/v1/runs/{run_id}/messages", json={"close": True})


def test_inferlets_are_listed_a_page_at_a_time(limited: Server) -> None:
    with limited.http(KEYS[13]) as http, limited.http(KEYS[14]) as other:
        mine = sorted(_upload(http, tiny(f"page-{i}")).json()["id"] for i in range(3))
        everything = http.get("/v1/inferlets", params={"limit": 1000}).json()["data"]  # shared ones too
        assert set(mine) <= {e["id"] for e in everything}
        assert [e["id"] for e in everything] == sorted(e["id"] for e in everything)
        assert _all_pages(http, "/v1/inferlets", 2) == everything
        first = http.get("/v1/inferlets", params={"limit": 1}).json()
        assert len(first["data"]) == 1 and first["has_more"] is True
        assert not set(mine) & {e["id"] for e in _all_pages(other, "/v1/inferlets", 1000)}
        for params in ({"limit": 0}, {"limit": 1001}, {"after": "latest"}):
            refused = http.get("/v1/inferlets", params=params)
            assert refused.status_code == 400 and refused.json()["error"]["param"] in params, refused.text


# ---------------------------------------------------------------------- uploads


def _quota_refusal(response: httpx.Response, words: str) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "upload_quota_exceeded" and words in error["message"], error


def test_a_key_may_keep_so_many_uploads_and_delete_frees_one(limited: Server) -> None:
    with limited.http(KEYS[15]) as http, limited.http(KEYS[16]) as other:
        theirs = tiny("theirs")
        assert _upload(other, theirs).status_code == 201
        ids = [_upload(http, tiny(f"count-{i}")).json()["id"] for i in range(3)]
        _quota_refusal(_upload(http, tiny("count-3")), "key_max_uploads")
        # Bytes another key has count whole for this one too (the answer must not tell them apart).
        _quota_refusal(_upload(http, theirs), "key_max_uploads")
        assert _upload(http, tiny("count-0")).status_code == 200  # already this key's: nothing more
        assert _upload(other, tiny("count-3")).status_code == 201  # the other key has its own quota
        assert http.delete(f"/v1/inferlets/{ids[0]}").json() == {"id": ids[0], "object": "inferlet", "deleted": True}
        assert _upload(http, tiny("count-3")).status_code == 201


def test_a_key_may_keep_so_many_bytes_uploaded(limited: Server) -> None:
    echo = limited.echo_wasm.read_bytes()
    with limited.http(KEYS[17]) as http, limited.http(KEYS[18]) as other:
        assert _upload(http, echo_variant(echo, "bytes-0")).status_code == 201
        assert _upload(http, echo_variant(echo, "bytes-1")).status_code == 201
        _quota_refusal(_upload(http, echo_variant(echo, "bytes-2")), "key_max_upload_bytes")
        assert _upload(other, echo_variant(echo, "bytes-2")).status_code == 201
        assert len(http.get("/v1/inferlets", params={"limit": 1000}).json()["data"]) >= 2


def test_a_key_deletes_its_own_uploads_only(limited: Server) -> None:
    data_dir = limited.config.data_dir / "inferlets"
    with limited.http(KEYS[19]) as a, limited.http(KEYS[20]) as b, limited.http(KEYS[21]) as c:
        both = _upload(a, tiny("both")).json()["id"]
        assert _upload(b, tiny("both")).status_code == 201
        hidden = _upload(c, tiny("hidden")).json()["id"]
        # Another key's upload: a 404, word for word what an id nobody uploaded gets.
        nobody = f"sha256:{'0' * 64}"
        refused, unknown = a.delete(f"/v1/inferlets/{hidden}"), a.delete(f"/v1/inferlets/{nobody}")
        assert refused.status_code == unknown.status_code == 404
        assert refused.json()["error"] == {
            **unknown.json()["error"],
            "message": unknown.json()["error"]["message"].replace(nobody, hidden),
        }
        assert c.get(f"/v1/inferlets/{hidden}").status_code == 200
        # Deleted for this key; the other key that uploaded the same bytes keeps them.
        assert a.delete(f"/v1/inferlets/{both}").status_code == 200
        assert a.get(f"/v1/inferlets/{both}").status_code == 404
        assert a.delete(f"/v1/inferlets/{both}").status_code == 404
        assert a.post("/v1/runs", json={"inferlet": both}).status_code == 404
        assert b.get(f"/v1/inferlets/{both}").status_code == 200
        assert (data_dir / f"{both.removeprefix('sha256:')}.json").exists()
        # The last key's delete removes the files, the compiled copy among them.
        compiled = limited.config.sandbox_config().compiled_dir / f"{cache_key(both.removeprefix('sha256:'))}.cwasm"
        assert compiled.exists()
        assert b.delete(f"/v1/inferlets/{both}").status_code == 200
        assert not list(data_dir.rglob(f"*{both.removeprefix('sha256:')}*"))
        assert not compiled.exists()
        # A shared upload: every key sees it, only a key that uploaded it may delete it.
        assert _upload(c, tiny("hidden"), shared="true").status_code == 200
        forbidden = a.delete(f"/v1/inferlets/{hidden}")
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "inferlet_not_owned"
        assert a.delete("/v1/inferlets/latest").status_code == 400


def test_an_upload_answers_the_same_whether_or_not_another_key_has_the_bytes(limited: Server) -> None:
    with limited.http(KEYS[22]) as a, limited.http(KEYS[23]) as b:
        first = _upload(a, tiny("same"))
        time.sleep(1.1)  # `created` counts seconds
        before = int(time.time())
        again = _upload(b, tiny("same"))
        fresh = _upload(b, tiny("not-the-same"))
    assert first.status_code == again.status_code == fresh.status_code == 201
    assert again.json().keys() == fresh.json().keys()
    assert again.json()["created"] >= before and again.json()["shared"] is False  # b's own upload time
    assert again.json() == {**first.json(), "created": again.json()["created"]}
    assert again.json()["created"] > first.json()["created"]


def test_deeply_nested_sources_are_a_400(limited: Server) -> None:
    nested = EMPTY_COMPONENT + _custom_section(SECTION_NAME.encode(), b"[" * 200_000)
    with limited.http(KEYS[0]) as http:
        response = _upload(http, nested)
    assert response.status_code == 400, response.text
    assert "nests its JSON too deeply" in response.json()["error"]["message"]


def test_sources_are_held_once_while_runs_use_them_and_not_after(limited: Server) -> None:
    assert limited.daemon is not None
    marker = "# held-once marker\n"
    data = echo_variant(limited.echo_wasm.read_bytes(), "held", marker + "x = 1\n" * 100_000)

    def copies() -> list[AppSources]:
        gc.collect()
        # type(), not isinstance(): isinstance reads `__class__`, which some objects warn on (torch's)
        found = [o for o in gc.get_objects() if type(o) is AppSources]
        return [o for o in found if any(marker in text for _, text in o.files)]

    with limited.http(KEYS[1]) as http:
        inferlet = _upload(http, data).json()["id"]
        assert copies() == []  # an upload holds nothing in memory
        ids = [http.post("/v1/runs", json={"inferlet": inferlet, "args": ["echo"]}).json()["id"] for _ in range(2)]
        runs = [limited.daemon.runs.get(run_id) for run_id in ids]
        assert runs[0].loaded is not None and runs[1].loaded is not None
        assert runs[0].loaded.app is runs[1].loaded.app and len(copies()) == 1  # one copy for both runs
        text = runs[0].loaded.app.files[-1][1]
        assert marker in text
        del runs
        # Deleted while it runs: the runs go on with what they hold.
        assert http.delete(f"/v1/inferlets/{inferlet}").status_code == 200
        for run_id in ids:
            http.post(f"/v1/runs/{run_id}/messages", json={"message": "hi", "close": True})
            with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
                assert list(events(response))[-1][1]["state"] == "succeeded"
    # Once no run holds them, nothing does (not the kept finished runs, not the compile cache).
    assert copies() == []
    gc.collect()
    assert sys.getrefcount(text) == 2  # `text` and the call's argument
