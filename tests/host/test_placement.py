"""Where a new run goes among replicas (host.engine.placement), on counts alone."""

from __future__ import annotations

from host.engine.placement import AFFINITY_SLACK_RUNS, AffinityIndex, Candidate, choose


def test_the_least_loaded_replica_then_the_most_free_pages() -> None:
    assert choose([Candidate(0, 3, 100), Candidate(1, 2, 10)]).index == 1
    assert choose([Candidate(0, 2, 10), Candidate(1, 2, 100)]).index == 1
    assert choose([Candidate(0, 2, 50), Candidate(1, 2, 50)]).index == 0


def test_a_replica_with_no_free_page_is_chosen_only_when_all_are_full() -> None:
    assert choose([Candidate(0, 0, 0), Candidate(1, 9, 5)]).index == 1
    assert choose([Candidate(0, 0, 0), Candidate(1, 9, 0)]).index == 0


def test_the_longest_cached_prefix_wins_while_its_replica_is_not_overloaded() -> None:
    assert choose([Candidate(0, 3, 100, 2), Candidate(1, 0, 100, 0)]).index == 0
    assert choose([Candidate(0, 1, 100, 2), Candidate(1, 1, 100, 5)]).index == 1
    overloaded = Candidate(0, AFFINITY_SLACK_RUNS + 1, 100, 8)
    assert choose([overloaded, Candidate(1, 0, 100, 0)]).index == 1
    # Past the fixed slack, half the least loaded replica's runs more is still acceptable.
    assert choose([Candidate(0, 30, 100, 8), Candidate(1, 20, 100, 0)]).index == 0
    assert choose([Candidate(0, 31, 100, 8), Candidate(1, 20, 100, 0)]).index == 1


def test_the_affinity_index_matches_leading_names_and_forgets_the_oldest() -> None:
    index = AffinityIndex(max_names=3)
    index.add([b"a", b"b"])
    assert index.matched([b"a", b"b", b"c"]) == 2 and index.matched([b"b"]) == 1 and index.matched([b"x", b"a"]) == 0
    index.add([b"c", b"d"])
    assert len(index) == 3 and index.matched([b"a"]) == 0
    index.clear()
    assert index.matched([b"c"]) == 0
