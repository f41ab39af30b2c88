"""Where a new run goes among the engine's replicas (host.engine.replicas): by prefix affinity,
then load and free pages. Pure: it sees counts and page names, never an engine, a lock or a clock.

Affinity is judged on what was *sent* to each replica: the names (host.engine.prefix_cache) of
the full pages of every prompt that started a context there. A replica's own cache may have evicted some
of them since; the guess then costs one recomputed prefix, never a wrong result.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# A replica with the longest cached prefix is chosen while it has at most this many more runs
# than the least loaded one (or half as many more, past that): affinity must not pile every run
# sharing a system prompt onto one replica.
AFFINITY_SLACK_RUNS = 4
# Page names remembered per replica (least recently routed forgotten first).
MAX_NAMES_PER_REPLICA = 1 << 16


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica that is up now: its index, the runs placed on it and still running, the KV
    pages a new pass could take there, and how many leading pages of the new run's first prompt
    were sent there before."""

    index: int
    num_runs: int
    available_pages: int
    matched_pages: int = 0


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The replica a new run goes to: among those with a free page (all, if none has one), the
    longest matched prefix while it is not overloaded, else the fewest runs, then the most
    available pages, then the lowest index."""
    assert candidates, "choose needs at least one replica that is up"
    pool = [c for c in candidates if c.available_pages > 0] or list(candidates)
    least = min(c.num_runs for c in pool)
    slack = max(AFFINITY_SLACK_RUNS, least // 2)
    affine = [c for c in pool if c.matched_pages > 0 and c.num_runs <= least + slack]
    if affine:
        return min(affine, key=lambda c: (-c.matched_pages, c.num_runs, -c.available_pages, c.index))
    return min(pool, key=lambda c: (c.num_runs, -c.available_pages, c.index))


class AffinityIndex:
    """The page names of prompts sent to one replica, bounded, most recently sent last."""

    def __init__(self, max_names: int = MAX_NAMES_PER_REPLICA) -> None:
        self._names: OrderedDict[bytes, None] = OrderedDict()
        self._max_names = max_names

    def __len__(self) -> int:
        return len(self._names)

    def matched(self, names: Sequence[bytes]) -> int:
        """How many leading names of a prompt (a hash chain: each names its whole prefix) are here."""
        count = 0
        for name in names:
            if name not in self._names:
                break
            count += 1
        return count

    def add(self, names: Sequence[bytes]) -> None:
        for name in names:
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self._max_names:
            self._names.popitem(last=False)

    def clear(self) -> None:
        """The replica restarted or was lost: its cache is gone."""
        self._names.clear()
