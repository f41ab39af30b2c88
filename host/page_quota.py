"""Shares of the KV page pool: at most a fraction for one run, and for one tenant (a group of
runs: the daemon's API key), so that no run and no key can take every page from the others.
Pure: the engine says what each run holds and what a pass needs; this says whether it may."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from host.errors import InvalidRequest, PageQuotaExceeded


@dataclass
class PageQuota:
    num_pages: int
    run_fraction: float = 1.0
    group_fraction: float = 1.0
    _groups: dict[int, str] = field(default_factory=dict)  # run -> group

    def __post_init__(self) -> None:
        for name in ("run_fraction", "group_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise InvalidRequest(f"{name} must be in (0, 1], got {value}")

    @property
    def run_pages(self) -> int:
        """The most pages one run may hold: its own share, within its group's."""
        return int(self.num_pages * min(self.run_fraction, self.group_fraction))

    @property
    def is_unlimited(self) -> bool:
        return self.run_fraction >= 1 and self.group_fraction >= 1

    def set_group(self, run_id: int, group: str) -> None:
        self._groups[run_id] = group

    def forget(self, run_id: int) -> None:
        self._groups.pop(run_id, None)

    def check(self, run_id: int, needed: int, held: Mapping[int, int]) -> None:
        """PageQuotaExceeded if `run_id` taking `needed` more pages would pass its run's or its
        group's share; `held`: the pages each run holds now."""
        run_quota = int(self.num_pages * self.run_fraction)
        mine = held.get(run_id, 0)
        if mine + needed > run_quota:
            raise PageQuotaExceeded(f"run {run_id}", mine, needed, run_quota, "run_max_pages_fraction")
        group = self._groups.get(run_id)
        if group is None or self.group_fraction >= 1:
            return
        group_quota = int(self.num_pages * self.group_fraction)
        theirs = sum(n for r, n in held.items() if self._groups.get(r) == group)
        if theirs + needed > group_quota:
            raise PageQuotaExceeded("the runs of its API key", theirs, needed, group_quota, "key_max_pages_fraction")
