"""What one run may hold through the grammar interface (matchers, their parse history, grammars),
driven by a real inferlet on the dummy driver, and that everything it held is freed when it ends."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from host.grammar import Matcher
from host.sandbox.config import RunHostLimits
from host.testing import InferletRunner

HOG = Path(__file__).parent / "inferlets" / "grammar_hog"


def _reports(messages: list[str], field: str) -> list[int]:
    return [json.loads(m)[field] for m in messages if field in json.loads(m)]


@pytest.mark.dummy(host_limits=RunHostLimits(matcher_tokens=5000))
def test_matcher_history_is_bounded_per_run(inferlet_runner: InferletRunner) -> None:
    """A loop of accepts (400,000 with 80 forks grew the daemon by 2.1 GiB) ends the run at the
    bound, naming it."""
    result = inferlet_runner.run(HOG, "history", "20000", "0")
    assert result.status == "limit_exceeded", result
    assert "grammar limit exceeded" in (result.error or "") and "the 5000 a run may" in (result.error or "")
    assert max(_reports(result.messages, "accepted")) == 4000


@pytest.mark.dummy(host_limits=RunHostLimits(matcher_tokens=10_000))
def test_a_fork_is_charged_the_history_it_copies(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(HOG, "history", "3000", "5")
    assert result.status == "limit_exceeded", result
    assert _reports(result.messages, "forks") == [1, 2]  # 3,000 + 2 x 3,000; a third passes 10,000


@pytest.mark.dummy(host_limits=RunHostLimits(matcher_tokens=5000))
def test_a_reset_keeps_its_charge_and_a_release_gives_it_back(inferlet_runner: InferletRunner) -> None:
    """The engine keeps a reset matcher's memory (measured), so a matcher is charged the most
    tokens it has held; a dropped one gives its charge back."""
    result = inferlet_runner.run(HOG, "resets", "3", "3000")
    assert result.status == "limit_exceeded", result
    assert _reports(result.messages, "rounds") == [3] and _reports(result.messages, "fresh") == []
    churn = inferlet_runner.run(HOG, "churn", "10", "3000")
    assert churn.ok, churn.error
    assert _reports(churn.messages, "matchers") == [10]


@pytest.mark.dummy(host_limits=RunHostLimits(matchers=50))
def test_live_matchers_are_bounded_per_run(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(HOG, "matchers", "100")
    assert result.status == "limit_exceeded", result
    assert "holds 50 matchers, the most a run may" in (result.error or "")
    assert max(_reports(result.messages, "matchers")) == 50


@pytest.mark.dummy(host_limits=RunHostLimits(grammars=20))
def test_grammars_are_bounded_per_run_by_count_and_bytes(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(HOG, "grammars", "30")
    assert result.ok, result.error  # a compile's error is the inferlet's to handle
    [report] = [json.loads(m) for m in result.messages]
    assert report["grammars"] == 20 and "holds 20 grammars, the most a run may" in report["error"]
    with InferletRunner(host_limits=RunHostLimits(grammar_bytes=20_000)) as runner:
        result = runner.run(HOG, "grammars", "30")
    [report] = [json.loads(m) for m in result.messages]
    assert 0 < report["grammars"] < 30 and "more than the 20000 a run may hold" in report["error"]


@pytest.mark.dummy(host_limits=RunHostLimits(grammars=10, matchers=10))
def test_grammars_and_matchers_a_guest_lets_go_do_not_count(inferlet_runner: InferletRunner) -> None:
    result = inferlet_runner.run(HOG, "transient", "50")
    assert result.ok, result.error
    assert _reports(result.messages, "grammars") == [50]


def test_what_a_run_held_is_freed_when_it_ends(inferlet_runner: InferletRunner) -> None:
    """Matchers (with their history) and forks a guest keeps until its end are gone after it."""

    def live_matchers() -> int:
        gc.collect()
        return sum(type(o) is Matcher for o in gc.get_objects())

    before = live_matchers()
    result = inferlet_runner.run(HOG, "leak", "20", "2000")
    assert result.ok and result.output == "kept", result.error
    assert live_matchers() == before
