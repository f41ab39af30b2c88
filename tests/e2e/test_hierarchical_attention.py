"""hierarchical_attention end to end on the recording dummy driver, speculation on (depth 1):
the driver receives one mask row per query, each exactly the README's rule (checked against an
independent set-based reading of it), distinct for distinct queries of the prefill; every decode
step carries its mask and leaves out pages it does not need; no masked request is served by a
staged fire."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from host.build import build
from host.engine import Engine, EngineConfig
from host.sandbox import Sandbox

PAGE = 4
CHUNK, SUMMARY, TOP, WINDOW, SINKS, QUERY_TOKENS = 16, 2, 2, 8, 2, 8
MAX_TOKENS = 40
WORDS = ("cat ", "sun ", "map ", "ox ", "tree ", "jam ", "fig ")
PROMPT = "".join(WORDS[(i * i + i // 3) % len(WORDS)] for i in range(36))  # ~140 byte tokens


@pytest.fixture(scope="module")
def recording_engine() -> Iterator[Engine]:
    args = ["--page-size", str(PAGE), "--num-pages", "4096"]
    with Engine.start(
        EngineConfig("loopback", args, driver_module="tests.e2e.recording_driver", speculation_depth=1)
    ) as e:
        yield e


def masked_log(engine: Engine) -> list[dict[str, Any]]:
    """The masked requests the recording driver received (see tests/e2e/recording_driver.py)."""
    return list(json.loads(str(engine.driver_health()["masked_log"])))


def attended(row: list[int]) -> set[int]:
    """The keys a BRLE row (false run first) lets a query see."""
    keys, pos = set(), 0
    for i, run in enumerate(row):
        if i % 2:
            keys.update(range(pos, pos + run))
        pos += run
    return keys


def expected(tokens: list[int], q: int) -> set[int]:
    """The README's rule for the query at slot q, written with sets."""
    own = q // CHUNK
    if own == 0:
        return set(range(q + 1))
    keys = set(range(SINKS)) | set(range(q - WINDOW + 1, q + 1))
    for j in range(own + 1):
        keys |= set(range(j * CHUNK, j * CHUNK + SUMMARY))
    recent = set(tokens[max(0, q - QUERY_TOKENS + 1) : q + 1])
    scores = sorted(((len(set(tokens[j * CHUNK : (j + 1) * CHUNK]) & recent), j) for j in range(own)), reverse=True)
    for score, j in scores[:TOP]:
        if score > 0:
            keys |= set(range(j * CHUNK, (j + 1) * CHUNK))
    return keys & set(range(q + 1))


def sees_a_whole_old_chunk(q: int, keys: set[int]) -> bool:
    """True if the query sees all of a chunk that ends before its window."""
    return any(set(range(j * CHUNK, (j + 1) * CHUNK)) <= keys for j in range((q - WINDOW + 1) // CHUNK))


def test_rows_follow_the_rule_and_no_mask_is_served_speculatively(
    sandbox: Sandbox, cache_dir: Path, recording_engine: Engine
) -> None:
    component = sandbox.load(build("hierarchical_attention", cache_dir).wasm_path)
    args = ["--prompt", PROMPT, "--chunk", str(CHUNK), "--summary", str(SUMMARY), "--top", str(TOP)]
    args += ["--window", str(WINDOW), "--sinks", str(SINKS), "--query-tokens", str(QUERY_TOKENS)]
    args += ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--temperature", "1", "--seed", "3"]
    seen = len(masked_log(recording_engine))
    requests_before = int(recording_engine.driver_health()["requests"])
    stats_before = recording_engine.speculation_stats()
    outcome = sandbox.run(component, recording_engine, args)
    assert outcome.is_ok, outcome.error
    log = masked_log(recording_engine)[seen:]
    assert int(recording_engine.driver_health()["requests"]) - requests_before == len(log) == MAX_TOKENS

    (prefill,) = [e for e in log if len(e["tokens"]) > 1]
    tokens = list(prefill["tokens"])
    assert prefill["first_position"] == 0 and tokens == list(PROMPT.encode())
    for q, row in enumerate(prefill["rows"]):
        assert attended(row) & set(range(q + 1)) == expected(tokens, q), q
    # Queries after the first chunk each have their own row, and some see a whole earlier chunk.
    assert len({tuple(row) for row in prefill["rows"][CHUNK:]}) == len(tokens) - CHUNK
    assert any(sees_a_whole_old_chunk(q, attended(row)) for q, row in enumerate(prefill["rows"]))

    decodes = [e for e in log if len(e["tokens"]) == 1]
    assert len(decodes) == MAX_TOKENS - 1
    for step in decodes:
        tokens += step["tokens"]
        q = step["first_position"]
        assert q == len(tokens) - 1
        (row,) = step["rows"]
        # Pages no key needs are left out, so the row is re-based: compare key counts (the
        # query is the last key of its pass).
        assert len(attended(row)) == len(expected(tokens, q)), q
    assert min(step["kv_len"] - (step["first_position"] + 1) for step in decodes) < 0  # pages were left out

    stats = recording_engine.speculation_stats()
    assert stats.get("speculation_hits", 0) == stats_before.get("speculation_hits", 0)
    assert stats.get("speculation_staged", 0) == stats_before.get("speculation_staged", 0)
    skipped = stats.get("speculation_skip_attention_mask", 0) - stats_before.get("speculation_skip_attention_mask", 0)
    assert skipped == MAX_TOKENS


def test_a_bad_shape_is_a_clear_error(sandbox: Sandbox, cache_dir: Path, recording_engine: Engine) -> None:
    component = sandbox.load(build("hierarchical_attention", cache_dir).wasm_path)
    outcome = sandbox.run(component, recording_engine, ["--prompt", "x", "--chunk", "0"])
    assert not outcome.is_ok and "chunk" in (outcome.error or ""), outcome.error
