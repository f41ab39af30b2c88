"""The inferlet test harness (host.testing, and the `inferlet_runner` fixture of wafer's pytest
plugin): the examples run through it on the dummy driver, with a scripted "model", messages both
ways, and what a run still held when it ended."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from host.testing import InferletRunner

HERE = Path(__file__).parent
ECHO = HERE.parents[0] / "host" / "daemon" / "inferlets" / "echo"
LEAKY = HERE / "inferlets" / "leaky"


@pytest.mark.dummy(say="Hello, world!")
def test_streaming_text_completion_says_the_script(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run("text_completion", "--prompt", "Hi", "--max-tokens", "40")
    assert result.ok and result.output == "Hello, world!"  # then end-of-text ended it
    assert result.contexts_held == 0 and result.pages_held == 0
    short = inferlet_runner.run("text_completion", "--prompt", "Hi", "--max-tokens", "5")
    assert short.output == "Hello"


@pytest.mark.dummy(say='{"name":"Ada","age":36}')
def test_grammar_constrained_json_follows_the_script_where_the_grammar_allows(
    inferlet_runner: InferletRunner,
) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    result = inferlet_runner.run("json_decoding", "--schema", json.dumps({**schema, "required": ["name", "age"]}))
    assert result.ok, result.error
    assert json.loads(result.output) == {"name": "Ada", "age": 36}
    assert result.messages == ['{"finish_reason": "stop"}']
    # A grammar that refuses the script: the draws stay inside its mask, and the JSON is valid.
    other = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    result = inferlet_runner.run("json_decoding", "--schema", json.dumps(other), "--max-tokens", "64")
    assert result.ok and result.output.startswith('{"n":')


@pytest.mark.dummy(say="ab")
def test_forked_branches_each_say_the_script_and_free_their_pages(inferlet_runner: InferletRunner) -> None:
    free = inferlet_runner.engine.num_free_pages
    result = inferlet_runner.run("parallel_generation", "--prompt", "x" * 40, "--branches", "3")
    assert result.ok, result.error
    assert result.output == "[0] ab\n[1] ab\n[2] ab\n"
    message = json.loads(result.messages[-1])
    assert message["branches"] == ["ab", "ab", "ab"]
    # Each sampled token's logprob under the dummy's uniform 260 tokens: "a", "b", end of text.
    assert message["logprobs"] == [round(-3 * math.log(260), 4)] * 3
    assert result.pages_held == 0 and inferlet_runner.engine.num_free_pages == free
    # The run's own pass requests: the prompt's fill, then 3 grouped steps (a, b, end) of 3 branches.
    assert result.passes == 1 + 3 * 3, result.passes


@pytest.mark.dummy(speculation_depth=0, pass_latency_ms=20)
def test_best_of_n_branches_each_sample_with_their_own_seed_and_share_passes(
    inferlet_runner: InferletRunner,
) -> None:
    """decode_steps_with_logprobs with a sampler per context: branch i of a run seeded 7 draws
    exactly as branch i-1 of a run seeded 8 (same seed, same positions), and the branches of a
    step reach the scheduler as one group: one device pass a step for all three (submitted one
    by one, the first branch's pass went out alone and the other two joined the next: 1 + 2 * 5)."""
    prompt = ("--prompt", "x" * 20, "--branches", "3", "--max-tokens", "5", "--ignore-eos")
    seven = inferlet_runner.run("parallel_generation", *prompt, "--seed", "7")
    assert seven.ok, seven.error
    assert seven.forwards == 1 + 5, seven.forwards  # the shared prompt, then one pass a step for all branches
    eight = inferlet_runner.run("parallel_generation", *prompt, "--seed", "8")
    a, b = json.loads(seven.messages[-1]), json.loads(eight.messages[-1])
    assert a["branches"][1:] == b["branches"][:2] and a["logprobs"][1:] == b["logprobs"][:2]
    assert a["branches"][0] != b["branches"][0]
    best = inferlet_runner.run("parallel_generation", *prompt, "--seed", "7", "--best")
    assert best.output == f"[{a['best']}] {a['branches'][a['best']]}\n"


GROUP = HERE / "inferlets" / "group"


def test_a_group_of_passes_gives_what_one_pass_at_a_time_gives(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(GROUP, "agree")
    assert result.ok, result.error
    report = json.loads(result.messages[-1])
    assert report["grouped"] == report["alone"]
    assert all(len(tokens) > 6 for tokens in report["grouped"])


def test_a_refused_pass_in_a_group_fails_alone(inferlet_runner: InferletRunner) -> None:
    """Each pass of `execute-all` gets its own result, in order: a bad token refuses its pass,
    and the passes either side of it still run and commit their tokens to the KV."""
    result = inferlet_runner.run(GROUP, "partial")
    assert result.ok, result.error
    good, bad, other, kv = json.loads(result.messages[-1])
    assert len(good["tokens"]) == 1 and len(other["tokens"]) == 1
    assert "input token out of range" in bad["error"], bad
    assert kv == {"kv": [2, 0, 1]}


@pytest.mark.parametrize("case", ["agree", "agree_random"])
def test_decode_steps_in_one_call_give_what_one_step_at_a_time_gives(
    inferlet_runner: InferletRunner, case: str
) -> None:
    """decode_steps on plain contexts is one `decode-all` host call a step, greedy or with a
    seeded sampler per context."""
    result = inferlet_runner.run(GROUP, case)
    assert result.ok, result.error
    report = json.loads(result.messages[-1])
    assert report["grouped"] == report["alone"]
    assert all(len(tokens) > 6 for tokens in report["grouped"])


@pytest.mark.dummy(speculation_depth=0, pass_latency_ms=20)
def test_decode_all_runs_its_contexts_in_one_device_pass_a_step(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(GROUP, "agree")
    assert result.ok, result.error
    # The grouped contexts: 1 pass a step for 6 steps; the others 3 a step, one at a time.
    assert result.forwards == 6 + 3 * 6, result.forwards
    assert result.speculation_hits == 0


def test_a_refused_step_in_decode_all_fails_alone(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(GROUP, "decode_partial")
    assert result.ok, result.error
    good, bad, other, kv = json.loads(result.messages[-1])
    assert isinstance(good["token"], int) and isinstance(other["token"], int)
    assert "input token out of range" in bad["error"], bad
    assert kv == {"kv": [2, 0, 1]}
    sdk = inferlet_runner.run(GROUP, "decode_sdk_partial")
    report = json.loads(sdk.messages[-1])
    assert "input token out of range" in report["error"]
    assert len(report["good"]) == 2 and report["committed"] == 1  # its step ran: token kept


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("duplicate", "a forward pass may appear only once"),
        ("unknown", "no live forward pass with id 4000000000"),
        ("released", "no live forward pass with id"),
        ("decode_duplicate", "a context may appear only once"),
        ("decode_unknown", "no live context with id 4000000000"),
        ("decode_released", "no live context with id"),
        ("decode_mismatch", "2 contexts, 1 token lists and 1 samplers"),
        ("decode_no_sampler", "1 contexts, 1 token lists and 0 samplers"),
    ],
)
def test_group_calls_trap_on_ids_that_are_not_distinct_and_live(
    inferlet_runner: InferletRunner, case: str, message: str
) -> None:
    """execute-all's pass ids and decode-all's context ids, as a bad handle would."""
    result = inferlet_runner.run(GROUP, case)
    assert result.status == "trapped", (result.status, result.error)
    assert message in (result.error or "")


def test_an_empty_group_returns_no_results(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(GROUP, "empty")
    assert result.ok and result.messages == ["[]"]


@pytest.mark.parametrize(
    ("case", "line", "message"),
    [
        ("emit_int", 8, "emit()'s text must be str, not int"),
        ("send_dict", 12, "send()'s message must be str, not dict"),
        ("fill_floats", 16, "fill()'s tokens (or give text as a str)[1] must be int, not float"),
        ("fill_int", 20, "fill()'s tokens (or give text as a str) must be an iterable of int, not int"),
        ("random_str", 24, "Random's temperature must be float or int, not str"),
        ("regex_int", 28, "Grammar.regex()'s pattern must be str, not int"),
    ],
)
def test_a_wrong_argument_type_is_a_type_error_at_the_authors_line(
    inferlet_runner: InferletRunner, case: str, line: int, message: str
) -> None:
    """Not a panic in the guest runtime once the value reaches the host: a TypeError naming the
    argument, with the author's file and line in the traceback."""
    result = inferlet_runner.run(HERE / "inferlets" / "typos", case)
    assert result.status == "guest_error", (result.status, result.error)
    error = result.error or ""
    assert f"TypeError: {message}" in error, error
    assert f'app.py", line {line}, in {case}' in error, error


def test_messages_both_ways(inferlet_runner: InferletRunner) -> None:
    live = inferlet_runner.start(ECHO, "echo")
    live.send("one")
    live.send("two")
    live.close()
    result = live.wait()
    assert result.ok and result.output == "echo: one\necho: two\n"
    assert result.messages == ['{"received": 2}']
    assert inferlet_runner.run(ECHO, "echo", messages=["x"]).messages == ['{"received": 1}']


@pytest.mark.dummy(page_size=16)
def test_what_a_run_still_held_is_counted(inferlet_runner: InferletRunner) -> None:
    held = inferlet_runner.run(LEAKY, "3", "40")  # 41 tokens each: 3 pages of 16
    assert held.ok and (held.contexts_held, held.pages_held) == (3, 9)
    released = inferlet_runner.run(LEAKY, "3", "40", "release")
    assert (released.contexts_held, released.pages_held) == (0, 0)
    assert inferlet_runner.engine.num_free_pages == inferlet_runner.engine.num_pages  # freed after either


def test_a_failing_run_reports_its_error(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run("text_completion", "--max-tokens", "4")  # --prompt is required
    assert not result.ok and result.status == "guest_error"
    assert "the following arguments are required: --prompt" in (result.error or "")


@pytest.mark.dummy(say="Hello, world!")
def test_a_run_result_counts_device_passes_and_speculation_hits(inferlet_runner: InferletRunner) -> None:
    """A guest loop of 13 decode steps after the prompt: with speculation on (depth 1), steps
    are answered by passes pre-fired while the guest handled the token before."""
    result = inferlet_runner.run("text_completion", "--prompt", "Hi", "--max-tokens", "40", "--per-token")
    assert result.ok and result.output == "Hello, world!"
    assert 0 < result.speculation_hits <= 13 and result.forwards >= 14


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_a_scripted_dummy_says_its_script_exactly_at_every_speculation_depth(depth: int) -> None:
    """Steps pre-fired and then discarded (the agent broke out of its loop, then added a prompt)
    do not consume the script: what each context says is the same with speculation off or on."""
    with InferletRunner(say="Paris\nFrance\nEurope\nEarth\n", speculation_depth=depth) as runner:
        result = runner.run(HERE / "inferlets" / "agent_turns", "2")
    assert result.ok, result.error
    assert json.loads(result.messages[-1]) == ["Paris", "France", "Europe", "Earth"]


def test_the_runner_works_without_pytest() -> None:
    with InferletRunner(say="ok", seed=3) as runner:
        assert runner.run("text_completion", "--prompt", "?", "--max-tokens", "8").output == "ok"


@pytest.mark.dummy(page_size=16, max_context=64)
def test_a_context_sees_its_pages_and_the_context_length(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(HERE / "inferlets" / "limits", "40")
    assert result.ok, result.error
    report = json.loads(result.messages[-1])
    # 39 tokens in the KV: 3 pages; the fork shares the 2 full ones and copies the partial one.
    assert report["pages"] == 3 and report["child_pages"] == 3 and report["in_use"] == 4
    assert report["room"] == 64 - 40
    assert report["generated"] == 25 and report["room_after"] == 0  # 64 positions used, one token pending
    assert "the context is full: 65 tokens, past the model's context length of 64" in result.output


@pytest.mark.dummy(logits={"a": 3.0, "b": 2.6, "c": 2.2})
def test_sampler_chains_through_every_sdk_path(inferlet_runner: InferletRunner) -> None:
    """The dummy's scripted logits make each chain's greedy text exact (a 3, b 2.6, c 2.2):
    a presence penalty of 1 gives a, b, c, then a for good; a frequency penalty of 0.5 a, b, a,
    c, b; a +100 bias forces its token; a mask and the chain compose; DRY breaks a's repeats."""
    result = inferlet_runner.run(str(HERE / "inferlets" / "chains"))
    assert result.ok, result.error
    lines = result.output.splitlines()
    mirostat = lines.pop()
    assert mirostat.startswith("mirostat ") and set(mirostat[9:]) <= {"a", "b", "c"} and len(mirostat) == 17
    # `step`: a, its logprob with b masked out (a 3, c 2.2, 257 tokens at 0), the top two; then b.
    expect = 3.0 - math.log(math.exp(3.0) + math.exp(2.2) + 257)
    assert lines.pop() == f"step a {expect:.3f} ['a', 'c'] b"
    assert lines[:-1] == [
        "probe k 20",
        "decode_step abcaa",
        "complete abacb",
        "decode_steps abc|zzz",
        "masked bcb",
        "dry aaabaaca",  # DRY through the one-call decode (tests/host/daemon/test_sampling_params.py)
    ]
    xtc = lines[-1]
    assert xtc.startswith("xtc ") and set(xtc[4:]) <= {"b", "c"} and len(xtc) == 10
