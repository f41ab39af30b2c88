"""OpenAI's frequency_penalty, presence_penalty and logit_bias, and vLLM's repetition_penalty,
top_k and min_p, through the real `openai` client: the daemon's dummy driver samples from
scripted logits (`--logits`), so each parameter's effect on the text is exact. The chat inferlet
passes them as a sampler chain that the driver runs (bridge_schema's "Sampler chain")."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import openai
import pytest

from tests.host.daemon.conftest import Server, _free_port, serving

# The dummy's model prefers a, then b, then c; every other token has logit 0.
LOGITS = "a=3,b=2.6,c=2.2"


@pytest.fixture(scope="module")
def scripted(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = dataclasses.replace(
        server.config,
        port=_free_port(),
        driver_args=("--max-context", "512", "--logits", LOGITS),
        data_dir=tmp_path_factory.mktemp("sampling-data"),
    )
    with serving(config, server.echo_wasm) as srv:
        yield srv


DRY_PARAMS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers")


def _complete(srv: Server, prompt: str = "xyz", **params: object) -> str:
    extensions = ("repetition_penalty", "repeat_penalty", "repeat_last_n", "top_k", "min_p", "typical_p")
    extensions += ("top_n_sigma", "xtc_probability")
    more = ("xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta", *DRY_PARAMS)
    extra = {k: params.pop(k) for k in (*extensions, *more) if k in params}
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 5)
    response = srv.client().completions.create(
        model="dummy",
        prompt=prompt,
        extra_body=extra or None,
        **params,  # type: ignore[arg-type]
    )
    return response.choices[0].text


def test_without_parameters_the_favourite_repeats(scripted: Server) -> None:
    assert _complete(scripted) == "aaaaa"


def test_presence_penalty_counts_the_completion_once(scripted: Server) -> None:
    # a 3 -> 2 once said: b (2.6), then c (2.2), then a (2.0) beats b (1.6) and c (1.2), twice.
    assert _complete(scripted, presence_penalty=1.0) == "abcaa"


def test_frequency_penalty_counts_every_occurrence(scripted: Server) -> None:
    # 0.5 per occurrence: a, b (2.6 > 2.5), a (2.5 > 2.2, 2.1), c (2.2 > 2.1, 2.0), b (2.1 > 2.0, 1.7).
    assert _complete(scripted, frequency_penalty=0.5) == "abacb"


def test_repetition_penalty_counts_the_prompt_too(scripted: Server) -> None:
    # "a" in the prompt: a's 3 / 2 = 1.5 from the start; b 2.6 -> 1.3, c 2.2 -> 1.1 once said.
    assert _complete(scripted, prompt="a", repetition_penalty=2.0) == "bcaaa"
    assert _complete(scripted, prompt="xyz", repetition_penalty=2.0) == "abcaa"


def test_llama_cpp_penalty_names(scripted: Server) -> None:
    """repeat_penalty is repetition_penalty; repeat_last_n counts only the last n tokens (1: the
    token just said, so a and b alternate), 0 turns the penalties off."""
    assert _complete(scripted, prompt="xyz", repeat_penalty=2.0) == "abcaa"
    assert _complete(scripted, prompt="xyz", repeat_penalty=2.0, repeat_last_n=1) == "ababa"
    assert _complete(scripted, prompt="xyz", repeat_penalty=2.0, repeat_last_n=0) == "aaaaa"
    with pytest.raises(openai.BadRequestError, match="name one penalty"):
        _complete(scripted, repeat_penalty=2.0, repetition_penalty=1.5)


def test_logit_bias_forces_and_bans(scripted: Server) -> None:
    assert _complete(scripted, logit_bias={str(ord("z")): 100}) == "zzzzz"
    assert _complete(scripted, logit_bias={str(ord("a")): -100}) == "bbbbb"
    # A random draw with a and b banned and the rest left at 0 against c's 2.2 at top_k 1: c.
    text = _complete(scripted, temperature=1.0, top_k=1, logit_bias={str(ord("a")): -100, str(ord("b")): -100})
    assert text == "ccccc"


def test_chat_takes_them_too(scripted: Server) -> None:
    response = scripted.client().chat.completions.create(
        model="dummy",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        presence_penalty=1.0,
        n=2,
    )
    assert [c.message.content for c in response.choices] == ["abca", "abca"]


def test_min_p_keeps_only_the_likely(scripted: Server) -> None:
    # Against a's probability, b's is e^-0.4 (0.67) and c's e^-0.8 (0.45): min_p 0.5 keeps a and b.
    texts = {_complete(scripted, temperature=1.0, min_p=0.5, seed=s) for s in range(6)}
    assert set("".join(texts)) <= {"a", "b"} and len(texts) > 1


def test_llama_cpp_filters(scripted: Server) -> None:
    # At temperature 0.3, a is 74% likely and b 20%: XTC at 0.15 removes a (b stays, the last of
    # the two above it), so the three candidates top_k leaves come down to b and c.
    texts = {
        _complete(scripted, temperature=0.3, top_k=3, xtc_probability=1.0, xtc_threshold=0.15, seed=s) for s in range(4)
    }
    assert set("".join(texts)) <= {"b", "c"}
    plain = {_complete(scripted, temperature=0.3, top_k=3, seed=s) for s in range(4)}
    assert "a" in "".join(plain)
    # top_n_sigma 0.01: only the best logit is near enough; typical_p passes through to the driver.
    assert _complete(scripted, temperature=1.0, top_n_sigma=0.01, seed=1) == "aaaaa"
    assert len(_complete(scripted, temperature=1.0, typical_p=0.5, seed=1)) == 5
    # Mirostat 2 at tau 3.5 (mu starts at 7 bits): the 256 tokens at 8.2 bits are out, so only
    # a, b, c (3.9, 4.5, 5.0 bits) and nothing else can come while mu stays low.
    texts = {
        _complete(scripted, temperature=1.0, mirostat=2, mirostat_tau=3.5, mirostat_eta=0.1, seed=s) for s in range(4)
    }
    assert set("".join(texts)) <= {"a", "b", "c"} and len(texts) > 1


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.0}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"typical_p": 0}, "typical_p"),
        ({"xtc_probability": 1.5}, "xtc_probability"),
        ({"mirostat": 1}, "mirostat"),
    ],
)
def test_out_of_range_is_a_400_naming_the_parameter(server: Server, params: dict, param: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(openai.BadRequestError) as err:
        _complete(server, **params)
    assert param in str(err.value)


def test_return_tokens_as_token_ids(scripted: Server) -> None:
    """vLLM's option: logprobs name tokens "token_id:N", in chat and legacy completions alike."""
    chat = scripted.client().chat.completions.create(
        model="dummy",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [c.token for c in content] == [f"token_id:{ord(ch)}" for ch in "aaa"]
    assert [t.token for t in content[0].top_logprobs] == [f"token_id:{ord('a')}", f"token_id:{ord('b')}"]
    legacy = scripted.client().completions.create(
        model="dummy",
        prompt="xyz",
        max_tokens=2,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens == [f"token_id:{ord('a')}"] * 2 and lp.text_offset == [0, 1]
    plain = scripted.client().completions.create(model="dummy", prompt="xyz", max_tokens=2, temperature=0, logprobs=1)
    assert plain.choices[0].logprobs.tokens == ["a", "a"]  # type: ignore[union-attr]


def test_dry_penalizes_what_would_continue_a_repeat(scripted: Server) -> None:
    """llama.cpp's DRY, base 2 from a repeat of 2: the third a continues "a a" (a: 3 - 1 < b);
    later "a a" has been followed by a and b, both drop by 1, and c (2.2) wins."""
    dry = {"dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 2}
    assert _complete(scripted, max_tokens=8, dry_sequence_breakers=[], **dry) == "aaabaaca"
    assert _complete(scripted, max_tokens=8, **dry) == "aaabaaca"  # llama.cpp's breakers are not in it
    assert _complete(scripted, max_tokens=8, dry_sequence_breakers=["a"], **dry) == "aaaaaaaa"  # a ends runs
    assert _complete(scripted, max_tokens=8, dry_penalty_last_n=0, **dry) == "aaaaaaaa"  # 0: off
    assert _complete(scripted, max_tokens=8, dry_penalty_last_n=2, **dry) == "aaaaaaaa"  # too short a window
    with pytest.raises(openai.BadRequestError, match="dry_base"):
        _complete(scripted, dry_multiplier=1.0, dry_base=0.5)
