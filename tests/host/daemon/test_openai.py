"""The OpenAI-compatible endpoints, driven by the real `openai` client against the daemon on the
dummy driver (whose greedy tokens depend only on the input token and position, and whose seeded
tokens only on the seed and position: outputs are reproducible)."""

from __future__ import annotations

import math

import openai
import pytest

from tests.host.daemon.conftest import Server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


def chat(server: Server, **kwargs: object) -> openai.types.chat.ChatCompletion:
    params: dict[str, object] = {"model": "dummy", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    params.update(kwargs)
    return server.client().chat.completions.create(**params)  # type: ignore[call-overload, no-any-return]


def test_models(server: Server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list()] == ["dummy"]
    assert client.models.retrieve("dummy").id == "dummy"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-17")
    assert info.value.code == "model_not_found"


def test_chat_completion(server: Server) -> None:
    response = chat(server)
    assert response.object == "chat.completion"
    assert response.model == "dummy"
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert response.usage is not None
    assert response.usage.prompt_tokens > 0
    assert 1 <= response.usage.completion_tokens <= 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert chat(server).choices[0].message.content == choice.message.content  # greedy is deterministic


def test_stream_equals_non_stream(server: Server) -> None:
    whole = chat(server, max_tokens=40)
    stream = server.client().chat.completions.create(
        model="dummy",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model="dummy",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=5,
        stream=True,
    )
    chunks = list(stream)
    assert chunks and all(c.choices for c in chunks)


def test_n_choices_share_the_prompt(server: Server) -> None:
    response = chat(server, n=3, temperature=1.0, seed=7, max_tokens=16, logprobs=True)
    assert [c.index for c in response.choices] == [0, 1, 2]
    texts = [c.message.content for c in response.choices]
    assert len(set(texts)) > 1  # each branch samples with its own seed
    assert response.usage is not None
    # Completion tokens count over every choice (one logprob entry per sampled token).
    assert response.usage.completion_tokens == sum(
        len(c.logprobs.content or []) for c in response.choices if c.logprobs
    )
    single = chat(server, n=1, temperature=1.0, seed=7, max_tokens=16)
    assert single.usage is not None
    assert response.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert single.choices[0].message.content == texts[0]  # branch 0 uses the seed itself


def test_n_choices_stream(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model="dummy",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        n=2,
        seed=3,
        stream=True,
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    whole = chat(server, n=2, seed=3, max_tokens=8, temperature=1.0)
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]


def test_seed_reproducibility(server: Server) -> None:
    a = chat(server, temperature=1.0, seed=42, max_tokens=24).choices[0].message.content
    b = chat(server, temperature=1.0, seed=42, max_tokens=24).choices[0].message.content
    c = chat(server, temperature=1.0, seed=43, max_tokens=24).choices[0].message.content
    assert a == b
    assert a != c


def test_ignore_eos_generates_through_stop_tokens(server: Server) -> None:
    """The dummy samples a stop token about once in 130 tokens: of 8 seeded choices of 300
    tokens some stop early, unless `ignore_eos` (an extension, as in vLLM) is set."""
    plain = chat(server, temperature=1.0, seed=5, n=8, max_tokens=300)
    assert any(c.finish_reason == "stop" for c in plain.choices)
    ignoring = chat(server, temperature=1.0, seed=5, n=8, max_tokens=300, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in ignoring.choices] == ["length"] * 8
    assert ignoring.usage is not None and ignoring.usage.completion_tokens == 8 * 300
    with pytest.raises(openai.BadRequestError):
        chat(server, extra_body={"ignore_eos": "yes"})


def test_stop_sequence(server: Server) -> None:
    full = chat(server, max_tokens=60).choices[0].message.content or ""
    printable = [i for i in range(5, len(full) - 2) if full[i].isalnum()]
    if not printable:
        pytest.skip("the dummy output has no printable character to stop at")
    at = printable[0]
    stop = full[at : at + 2]
    cut = full.index(stop)
    response = chat(server, max_tokens=60, stop=[stop, "\u2603never"])
    assert response.choices[0].message.content == full[:cut]
    assert response.choices[0].finish_reason == "stop"
    streamed = server.client().chat.completions.create(
        model="dummy",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0,
        stop=stop,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:cut]


def test_chat_logprobs(server: Server) -> None:
    response = chat(server, logprobs=True, top_logprobs=3, max_tokens=6)
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert response.usage is not None
    assert len(choice.logprobs.content) == response.usage.completion_tokens
    for entry in choice.logprobs.content:
        assert math.isclose(entry.logprob, -math.log(260), rel_tol=1e-5)  # the dummy's uniform distribution
        assert len(entry.top_logprobs) == 3
        assert isinstance(entry.token, str) and isinstance(entry.bytes, list)
    assert chat(server, logprobs=False).choices[0].logprobs is None
    just_chosen = chat(server, logprobs=True, max_tokens=4).choices[0].logprobs
    assert just_chosen is not None and just_chosen.content
    assert all(e.top_logprobs == [] for e in just_chosen.content)


def test_chat_logprobs_stream(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model="dummy",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    entries = []
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                entries += c.logprobs.content
    assert usage is not None and len(entries) == usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_completions(server: Server) -> None:
    client = server.client()
    one = client.completions.create(model="dummy", prompt="Once upon a time", temperature=0)
    assert one.object == "text_completion"
    assert one.usage is not None
    assert one.usage.prompt_tokens == len("Once upon a time")  # the dummy's byte tokenizer
    assert one.usage.completion_tokens <= 16  # the legacy endpoint's default max_tokens
    batch = client.completions.create(model="dummy", prompt=["ab", "cd"], n=2, max_tokens=4, seed=1)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    tokens = client.completions.create(model="dummy", prompt=[79, 110, 99, 101], max_tokens=4, temperature=0)
    assert (
        tokens.choices[0].text
        == client.completions.create(model="dummy", prompt="Once", max_tokens=4, temperature=0).choices[0].text
    )


def test_completions_echo_the_prompt(server: Server) -> None:
    client = server.client()
    plain = client.completions.create(model="dummy", prompt=["ab", "cd"], max_tokens=4, seed=7)
    echoed = client.completions.create(model="dummy", prompt=["ab", "cd"], max_tokens=4, seed=7, echo=True)
    assert [c.text for c in echoed.choices] == ["ab" + plain.choices[0].text, "cd" + plain.choices[1].text]
    by_ids = client.completions.create(model="dummy", prompt=[79, 110], max_tokens=2, seed=7, echo=True)
    assert by_ids.choices[0].text.startswith("On")  # token ids echo as their text
    assert echoed.usage is not None and echoed.usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model="dummy", prompt=["ab", "cd"], max_tokens=4, seed=7, echo=True, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: echoed.choices[0].text, 1: echoed.choices[1].text}


def test_completions_echo_the_prompts_logprobs(server: Server) -> None:
    """Each prompt token's logprob given the ones before (the first has none), then the
    generated tokens': the legacy API's scoring use. The dummy's distribution is uniform over
    its 260 tokens."""
    client = server.client()
    resp = client.completions.create(model="dummy", prompt="abc", max_tokens=3, seed=2, echo=True, logprobs=2)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert choice.text.startswith("abc") and "".join(lp.tokens) == choice.text
    assert lp.tokens[:3] == ["a", "b", "c"] and lp.text_offset[:4] == [0, 1, 2, 3]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([-math.log(260)] * (len(lp.tokens) - 1), abs=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert len(lp.tokens) == 3 + 3
    streamed_text, streamed_tokens = "", []
    for chunk in client.completions.create(
        model="dummy", prompt="abc", max_tokens=3, seed=2, echo=True, logprobs=2, stream=True
    ):
        for c in chunk.choices:
            streamed_text += c.text
            streamed_tokens += (c.logprobs.tokens or []) if c.logprobs else []
    assert streamed_text == choice.text and streamed_tokens == lp.tokens


def test_completions_logprobs_and_stream(server: Server) -> None:
    client = server.client()
    response = client.completions.create(model="dummy", prompt="abc", max_tokens=5, logprobs=2, temperature=0)
    lp = response.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert response.usage is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == response.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    stream = client.completions.create(
        model="dummy", prompt="abc", max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == response.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == response.usage.completion_tokens


def test_tool_choice_none_generates_text(server: Server) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    response = chat(server, tools=tools, tool_choice="none")
    assert response.choices[0].message.tool_calls is None


def test_concurrent_requests(server: Server) -> None:
    """40 requests at once (streamed and not, n > 1, seeded): all complete, each with the output it
    would have alone (batching must not mix contexts up)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[str, str]:
        kwargs: dict[str, object] = {"temperature": 1.0, "seed": 1000 + i, "max_tokens": 8}
        if i % 2:
            stream = server.client().chat.completions.create(
                model="dummy",
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
                **kwargs,  # type: ignore[arg-type]
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            return streamed, chat(server, **kwargs).choices[0].message.content or ""
        response = chat(server, n=2, **kwargs)
        assert len(response.choices) == 2
        return response.choices[0].message.content or "", chat(server, **kwargs).choices[0].message.content or ""

    with ThreadPoolExecutor(max_workers=40) as pool:
        results = list(pool.map(one, range(40)))
    for together, alone in results:
        assert together == alone
