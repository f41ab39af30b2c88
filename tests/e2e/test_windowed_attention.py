"""windowed_attention end to end on the recording dummy driver, speculation on (depth 1): the
prefill sends one mask row per query, each its own window (not one row reused for every query);
every decode step carries its mask; and no masked request is served by a staged fire."""

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
WINDOW, SINKS, MAX_TOKENS = 8, 4, 24


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


def test_each_query_sees_its_own_window_and_no_mask_is_served_speculatively(
    sandbox: Sandbox, cache_dir: Path, recording_engine: Engine
) -> None:
    component = sandbox.load(build("windowed_attention", cache_dir).wasm_path)
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(40))  # 40 byte tokens
    args = ["--prompt", prompt, "--window", str(WINDOW), "--sinks", str(SINKS)]
    args += ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--temperature", "1", "--seed", "1"]
    seen = len(masked_log(recording_engine))
    requests_before = int(recording_engine.driver_health()["requests"])
    stats_before = recording_engine.speculation_stats()
    outcome = sandbox.run(component, recording_engine, args)
    assert outcome.is_ok, outcome.error
    log = masked_log(recording_engine)[seen:]

    # Every pass the run made was masked: the prefill and each decode step.
    assert int(recording_engine.driver_health()["requests"]) - requests_before == len(log) == MAX_TOKENS
    (prefill,) = [e for e in log if len(e["tokens"]) > 1]
    assert prefill["first_position"] == 0 and len(prefill["rows"]) == len(prompt)
    for query, row in enumerate(prefill["rows"]):
        own = set(range(SINKS)) | set(range(max(0, query - WINDOW + 1), query + 1))
        assert attended(row) & set(range(query + 1)) == own & set(range(query + 1)), query
    # Queries past the first window each have their own row.
    assert len({tuple(row) for row in prefill["rows"][WINDOW:]}) == len(prompt) - WINDOW

    decodes = [e for e in log if len(e["tokens"]) == 1]
    assert len(decodes) == MAX_TOKENS - 1
    for step in decodes:
        (row,) = step["rows"]
        # The query is the last key of its pass (pages no row needs are left out).
        assert len(attended(row)) == min(step["first_position"] + 1, SINKS + WINDOW), step

    stats = recording_engine.speculation_stats()
    assert stats.get("speculation_hits", 0) == stats_before.get("speculation_hits", 0)
    assert stats.get("speculation_staged", 0) == stats_before.get("speculation_staged", 0)
    skipped = stats.get("speculation_skip_attention_mask", 0) - stats_before.get("speculation_skip_attention_mask", 0)
    assert skipped == MAX_TOKENS
