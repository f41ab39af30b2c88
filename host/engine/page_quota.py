"""Shares of the KV page pool: at most a fraction for one run, and for one tenant (a group of
runs: the daemon's API key), so that no run and no key can take every page from the others.
Shares may overlap (two keys of 0.75), so the pool's last pages are kept too: a group that holds
a reserve's worth already may not take the last free ones, and a key that holds little can
always get that much. Pure: the engine says what each run holds, what is free and what a pass
needs; this says whether it may."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from host.errors import InvalidRequest, PageQuotaExceeded


@dataclass
class PageQuota:
    num_pages: int
    run_fraction: float = 1.0
    group_fraction: float = 1.0
    group_reserve_fraction: float = 0.0
    _groups: dict[int, str] = field(default_factory=dict)  # run -> group

    def __post_init__(self) -> None:
        for name in ("run_fraction", "group_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise InvalidRequest(f"{name} must be in (0, 1], got {value}")
        if not 0 <= self.group_reserve_fraction < 1:
            raise InvalidRequest(f"group_reserve_fraction must be in [0, 1), got {self.group_reserve_fraction}")

    @property
    def run_pages(self) -> int:
        """The most pages one run may hold: its own share, within its group's."""
        return int(self.num_pages * min(self.run_fraction, self.group_fraction))

    @property
    def is_unlimited(self) -> bool:
        return self.run_fraction >= 1 and self.group_fraction >= 1 and self.group_reserve_fraction <= 0

    def set_group(self, run_id: int, group: str) -> None:
        self._groups[run_id] = group

    def forget(self, run_id: int) -> None:
        self._groups.pop(run_id, None)

    def check(self, run_id: int, needed: int, held: Mapping[int, int], num_free: int | None = None) -> None:
        """PageQuotaExceeded if `run_id` taking `needed` more pages would pass its run's or its
        group's share, or take a group that holds a reserve's worth into the pool's last
        reserve; `held`: the pages each run holds now; `num_free`: pages free in the pool."""
        run_quota = int(self.num_pages * self.run_fraction)
        mine = held.get(run_id, 0)
        if mine + needed > run_quota:
            raise PageQuotaExceeded(f"run {run_id}", mine, needed, run_quota, "run_max_pages_fraction")
        group = self._groups.get(run_id)
        if group is None:
            return
        theirs = sum(n for r, n in held.items() if self._groups.get(r) == group)
        group_quota = int(self.num_pages * self.group_fraction)
        if theirs + needed > group_quota:
            raise PageQuotaExceeded("the runs of its API key", theirs, needed, group_quota, "key_max_pages_fraction")
        reserve = int(self.num_pages * self.group_reserve_fraction)
        if num_free is not None and theirs + needed > reserve and num_free - needed < reserve:
            limit = (
                f"the {reserve} pages the pool keeps free for keys that hold fewer (the daemon's "
                f"key_reserve_pages_fraction; {num_free} are free)"
            )
            raise PageQuotaExceeded("the runs of its API key", theirs, needed, reserve, "", limit)
