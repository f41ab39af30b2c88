"""`host.engine.page_quota`: a run's share and its group's (an API key's) share of the page pool."""

from __future__ import annotations

import pytest

from host.engine.page_quota import PageQuota
from host.errors import InvalidRequest, PageQuotaExceeded


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


def test_keys_with_overlapping_shares_leave_the_pool_s_last_pages_to_a_third() -> None:
    """Two keys of 0.75 each could take the whole pool between them; with a reserve of 0.1 the
    last 10 pages go only to a key that holds fewer than 10."""
    quota = PageQuota(100, run_fraction=0.75, group_fraction=0.75, group_reserve_fraction=0.1)
    for run, group in ((1, "key-a"), (2, "key-b"), (3, "key-c")):
        quota.set_group(run, group)
    held = {1: 75, 2: 0, 3: 0}
    quota.check(2, 15, held, num_free=25)  # key-b down to the reserve
    with pytest.raises(PageQuotaExceeded, match=r"the 10 pages the pool keeps free .*key_reserve_pages_fraction"):
        quota.check(2, 16, held, num_free=25)
    held[2] = 15
    quota.check(3, 10, held, num_free=10)  # key-c gets the reserve
    with pytest.raises(PageQuotaExceeded, match="key_reserve_pages_fraction"):
        quota.check(3, 11, held, num_free=10)
    with pytest.raises(InvalidRequest, match="group_reserve_fraction"):
        PageQuota(10, group_reserve_fraction=1.0)
