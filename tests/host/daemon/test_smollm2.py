"""The daemon on the torch driver with SmolLM2 (the embedded default model), driven by the real
openai client: a real answer, streaming equal to non-streaming, and grammar-constrained JSON and
tool calls from a real model, and finished outputs that validate for a sample of the schema
corpus (tests/data/jsonschemas)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest
import uvicorn

from drivers.torch.weights.gguf_loader import smollm2_path
from host.cli.commands import build_parser
from host.daemon.app import create_app
from host.daemon.cli import config_of
from host.daemon.daemon import Daemon
from host.sandbox.config import default_cache_dir
from tests.host.daemon.conftest import _free_port

MODEL = "SmolLM2-135M-Instruct"
CORPUS = Path(__file__).resolve().parents[2] / "data" / "jsonschemas" / "schemas"
# Accepted by the engine (tests/host/daemon/test_schema_corpus.py), from trivial to medium: an
# enum, a nested object, a pattern, enums in arrays, $ref with const, a Kubernetes object.
CORPUS_SAMPLE = (
    "151_WashingtonPost_wp_38_Normalized.json",
    "179_BFCL_simple_BFCL_simple_11.json",
    "261_sglang_json_constrained_kit.json",
    "257_vllm_sample_enum_json_schema.json",
    "239_MCPspec_SetLevelRequest.json",
    "129_Kubernetes_kb_38_Normalized.json",
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """`wafer serve path/to/model.gguf`, as a user types it: the model file as the argument (it
    implies the torch driver) and the name clients call it by."""
    parser, _ = build_parser()
    argv = ["serve", str(smollm2_path()), "--served-model-name", MODEL, "--port", str(_free_port())]
    argv += ["--driver-arg=--threads", "--driver-arg=1", "--driver-arg=--dtype", "--driver-arg=float32"]
    argv += ["--data-dir", str(tmp_path_factory.mktemp("daemon-smollm2")), "--log-level", "warning"]
    with pytest.MonkeyPatch.context() as patch:  # the command line alone, whatever WAFER_* is set
        for key in [k for k in os.environ if k.startswith("WAFER_")]:
            patch.delenv(key)
        config = dataclasses.replace(config_of(parser.parse_args(argv)), cache_dir=default_cache_dir())
    assert config.replica_drivers == ("torch",) and config.driver_argv[:2] == ("--model", str(smollm2_path()))
    daemon = Daemon(config)
    server = uvicorn.Server(
        uvicorn.Config(create_app(config, daemon), host=config.host, port=config.port, log_config=None)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    with openai.OpenAI(api_key="none", base_url=f"{config.url}/v1", max_retries=0, timeout=300.0) as c:
        deadline = time.monotonic() + 300
        while True:  # ready once /health says so: SmolLM2 loads first
            try:
                if httpx.get(f"{config.url}/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the daemon did not get ready"
            time.sleep(0.5)
        yield c
    server.should_exit = True
    thread.join(timeout=60)


def ask(client: openai.OpenAI, content: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, **kw
    )


def test_answers_and_streams_the_same(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    resp = ask(client, "What is the capital of France?", max_tokens=20)
    assert "Paris" in (resp.choices[0].message.content or "")
    stream = ask(client, "What is the capital of France?", max_tokens=20, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == resp.choices[0].message.content


def test_json_schema_from_a_real_model(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    resp = ask(client, "Invent a person and give their name and age as JSON.", response_format=fmt, max_tokens=60)
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), PERSON)


def test_a_forced_tool_call_from_a_real_model(client: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "register", "parameters": PERSON}}]
    choice: Any = {"type": "function", "function": {"name": "register"}}
    resp = ask(client, "Register Alice, who is 30.", tools=tools, tool_choice=choice, max_tokens=60)
    (call,) = resp.choices[0].message.tool_calls or []
    assert resp.choices[0].finish_reason == "tool_calls" and call.function.name == "register"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PERSON)


def test_corpus_schemas_from_a_real_model_validate_when_finished(client: openai.OpenAI) -> None:
    """Measured: 4 of the 6 finish (the pattern and Kubernetes ones hit max_tokens), about 20 s."""
    finished = []
    for name in CORPUS_SAMPLE:
        schema = json.loads((CORPUS / name).read_text())
        fmt: Any = {"type": "json_schema", "json_schema": {"name": "corpus", "schema": schema, "strict": True}}
        resp = ask(client, "Give an example as JSON.", response_format=fmt, max_tokens=100)
        choice = resp.choices[0]
        if choice.finish_reason == "stop":
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            check = cls(schema, format_checker=cls.FORMAT_CHECKER)
            errors = [e.message for e in check.iter_errors(json.loads(choice.message.content or ""))]
            assert not errors, (name, choice.message.content, errors)
            finished.append(name)
    assert len(finished) >= 3, finished


def test_echoed_prompt_logprobs_score_the_models_own_continuation(client: openai.OpenAI) -> None:
    """Greedy one token after a prompt, then echo that prompt plus the token with logprobs: the
    last prompt token's logprob is the one the generation reported (same context, same
    distribution), so each prompt row is scored at the right position."""
    prompt = "The capital of France is"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    lp = first.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs
    scored = client.completions.create(
        model=MODEL, prompt=prompt + lp.tokens[0], max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    echo = scored.choices[0].logprobs
    assert echo is not None and echo.tokens and echo.token_logprobs
    n = len(echo.tokens) - 1  # the prompt's tokens, then the one generated
    assert echo.token_logprobs[0] is None and "".join(echo.tokens[:n]) == prompt + lp.tokens[0]
    assert echo.tokens[n - 1] == lp.tokens[0]
    assert echo.token_logprobs[n - 1] == pytest.approx(lp.token_logprobs[0], abs=2e-3)
    assert all(v is not None and v <= 0 for v in echo.token_logprobs[1:])
