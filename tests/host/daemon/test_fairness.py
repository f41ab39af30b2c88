"""One tenant's big request against the others: a run with a thousand contexts decoding, a run
that wants more contexts than a run may hold, completions with too many prompts, and
hand-built components that would sleep in WASI or hold eight memories. The other key is served
meanwhile, and each attack ends with an error naming its limit."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from host.build import build
from host.sandbox.config import default_cache_dir
from tests.host.daemon.conftest import OTHER_KEY, Server
from tests.host.daemon.sse import events
from tests.host.sandbox import hand_built

HERE = Path(__file__).parent


def _upload(server: Server, data: bytes) -> str:
    with server.http() as http:
        response = http.post("/v1/inferlets", content=data)
        assert response.status_code in (200, 201), response.text
        return str(response.json()["id"])


@pytest.fixture(scope="module")
def crowd_id(server: Server) -> str:
    return _upload(server, build(str(HERE / "inferlets" / "crowd"), default_cache_dir()).wasm_path.read_bytes())


def _chat(server: Server) -> bool:
    """Whether the other key's chat completes (the dummy's tokens may stop it early)."""
    reply = server.client(OTHER_KEY).chat.completions.create(
        model="dummy", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=1
    )
    return reply.choices[0].finish_reason in ("length", "stop")


def test_another_key_is_served_while_a_run_decodes_a_thousand_contexts(server: Server, crowd_id: str) -> None:
    with server.http() as http:
        run_id = http.post("/v1/runs", json={"inferlet": crowd_id, "args": ["1000"]}).json()["id"]
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            steps = 0
            for name, data in events(response):
                assert name != "end", data
                steps += name == "output" and data["text"] == "."
                if steps == 2:  # every context decodes: now the other key asks
                    break
        assert all(_chat(server) for _ in range(3))
        assert http.get("/health").status_code == 200
        assert http.get(f"/v1/runs/{run_id}").json()["state"] == "running"
        assert http.post(f"/v1/runs/{run_id}/cancel").json()["state"] == "cancelled"


def test_a_run_holds_at_most_run_max_contexts(server: Server, crowd_id: str) -> None:
    limit = server.config.run_max_contexts
    with server.http() as http:
        run_id = http.post("/v1/runs", json={"inferlet": crowd_id, "args": [str(limit + 1)]}).json()["id"]
        with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
            seen = list(events(response))
    assert seen[-1][0] == "end" and seen[-1][1]["state"] == "failed"
    assert f"holds {limit} contexts, the most a run may (run_max_contexts)" in seen[-1][1]["error"]
    assert _chat(server)


def test_completions_take_a_bounded_number_of_prompts_and_choices(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="129 prompts, past the 128 one request may have"):
        client.completions.create(model="dummy", prompt=["a"] * 129, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"100 prompts with n=3 ask for 300 choices, past the 256"):
        client.completions.create(model="dummy", prompt=["a"] * 100, n=3, max_tokens=1)
    assert len(client.completions.create(model="dummy", prompt=["a"] * 128, n=2, max_tokens=1).choices) == 256


def test_the_completions_bounds_are_the_operators(server: Server, tmp_path: Path) -> None:
    """`completions_max_prompts` and `completions_max_choices` reach the route."""
    from host.daemon.config import load_config
    from tests.host.daemon.conftest import API_KEY, _free_port, serving

    keys = {"completions_max_prompts": 3, "completions_max_choices": 4, "driver": "dummy", "api_keys": [API_KEY]}
    config = load_config({**keys, "port": _free_port(), "data_dir": str(tmp_path), "log_level": "warning"}, environ={})
    with serving(config, server.echo_wasm) as small:
        client = small.client()
        with pytest.raises(openai.BadRequestError, match="4 prompts, past the 3 one request may have"):
            client.completions.create(model="dummy", prompt=["a"] * 4, max_tokens=1)
        with pytest.raises(openai.BadRequestError, match=r"2 prompts with n=3 ask for 6 choices, past the 4"):
            client.completions.create(model="dummy", prompt=["a"] * 2, n=3, max_tokens=1)
        assert len(client.completions.create(model="dummy", prompt=["a"] * 3, max_tokens=1).choices) == 3


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (hand_built.clock_sleeper("0.2.0", 3600), "imports|cannot sleep"),
        (hand_built.clock_sleeper("0.2.10", 3600), "wasi:clocks/monotonic-clock@0.2.10"),
        (hand_built.many_memories(8, 240), "the component needs more than a run may have"),
    ],
    ids=["clock-0.2.0", "clock-0.2.10", "8-memories"],
)
def test_hand_built_components_end_or_are_refused_with_their_limit(
    server: Server, tmp_path: Path, text: str, error: str
) -> None:
    data = hand_built.write(text, tmp_path / "hostile.wasm").read_bytes()
    with server.http() as http:
        uploaded = http.post("/v1/inferlets", content=data)
        if uploaded.status_code == 400:  # refused at upload, naming the import
            assert any(part in uploaded.text for part in error.split("|")), uploaded.text
            return
        assert uploaded.status_code in (200, 201), uploaded.text
        runs = [http.post("/v1/runs", json={"inferlet": uploaded.json()["id"]}).json()["id"] for _ in range(8)]
        for run_id in runs:
            with http.stream("GET", f"/v1/runs/{run_id}/events") as response:
                end = [data for name, data in events(response) if name == "end"][-1]
            assert end["state"] == "failed"
            assert any(part in end["error"] for part in error.split("|")), end["error"]
    assert _chat(server)


def test_choices_whose_forks_cannot_fit_the_run_s_pages_are_a_400_before_any_work(server: Server) -> None:
    """n choices each hold their prompt's pages: past the run's share, the run could only fail
    after its prompt was computed (a 502); it is refused up front instead."""
    assert server.daemon is not None
    engine, _ = server.daemon.supervisor.engine(timeout_s=30)
    prompt = [7] * 400
    pages = -(-len(prompt) // engine.model.page_size)
    run_pages = engine.model.run_max_tokens // engine.model.page_size
    n = min(128, run_pages // pages + 1)
    assert n * pages + n - 1 > run_pages, "the dummy's pool is too big for this test"
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="run_max_pages_fraction") as info:
        client.completions.create(model="dummy", prompt=prompt, n=n, max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    assert client.completions.create(model="dummy", prompt=prompt, n=2, max_tokens=1).choices
