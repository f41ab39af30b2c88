"""`host.page_quota`: a run's share and its group's (an API key's) share of the page pool."""

from __future__ import annotations

import pytest

from host.errors import InvalidRequest, PageQuotaExceeded
from host.page_quota import PageQuota


def test_a_run_and_a_group_each_have_a_share() -> None:
    quota = PageQuota(100, run_fraction=0.5, group_fraction=0.75)
    for run, group in ((1, "key-a"), (2, "key-a"), (3, "key-b")):
        quota.set_group(run, group)
    held = {1: 40, 2: 20, 3: 50}
    quota.check(1, 10, held)  # 50 of the run's 50
    with pytest.raises(PageQuotaExceeded, match=r"run 1 holds 40 KV pages .* past the quota of 50 .*run_max"):
        quota.check(1, 11, held)
    quota.check(2, 15, held)  # key-a: 75 of 75
    with pytest.raises(PageQuotaExceeded, match=r"the runs of its API key hold 60 KV pages .* quota of 75 .*key_max"):
        quota.check(2, 16, held)
    quota.check(3, 0, held)  # key-b's own share is untouched by key-a
    quota.forget(2)
    quota.check(2, 20, held)  # ungrouped: only the run's share applies


def test_fractions_are_checked() -> None:
    assert PageQuota(10).is_unlimited
    with pytest.raises(InvalidRequest, match="group_fraction must be in"):
        PageQuota(10, group_fraction=0)
