"""Shared per-key budgets, pure: the sliding minute and when a refused request may retry,
admission from the shared view plus this process's unsynced usage, each replica's share of
what was left between two syncs (several replicas flooding one key together stay within
1.1x of its budget, simulated against an in-memory stand-in for Redis's counters), the
fallback to local shares when the shared view is stale, and usage made meanwhile added once
Redis is back."""

from __future__ import annotations

import math
import random

import pytest

from app.budgets.shared import (
    WINDOW_S,
    SharedBudgets,
    SyncBatch,
    seconds_until_fits,
    sliding_total,
    window_of,
)


def test_the_sliding_minute_weighs_the_previous_one_by_what_it_still_covers() -> None:
    counts = {10: 100, 9: 200}
    assert sliding_total(counts, 10 * WINDOW_S) == pytest.approx(300)
    assert sliding_total(counts, 10.5 * WINDOW_S) == pytest.approx(200)
    assert sliding_total(counts, 11 * WINDOW_S) == pytest.approx(100)  # 10 is now previous


def test_a_refused_request_is_told_when_it_fits() -> None:
    counts = {10: 100, 9: 200}
    at = 10 * WINDOW_S
    assert seconds_until_fits(counts, at, 50, 400) == 0.0
    # 300 + 150 > 400: wait until the previous minute weighs 150 (a quarter of it gone).
    assert seconds_until_fits(counts, at, 150, 400) == pytest.approx(WINDOW_S / 4)
    # Beyond what this minute can take: into the next one.
    wait = seconds_until_fits(counts, at, 350, 400)
    assert wait == pytest.approx(WINDOW_S + WINDOW_S * (1 - 50 / 100))
    assert sliding_total(counts, at + wait) + 350 == pytest.approx(400)
    assert math.isinf(seconds_until_fits(counts, at, 401, 400))


class FakeRedis:
    """Redis's counters and roll call as the sync uses them."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}

    def sync(self, budgets: SharedBudgets, batch: SyncBatch, replicas: int, now: float) -> None:
        for name, window, tokens in batch.increments:
            key = f"{name}:{window}"
            self.counters[key] = self.counters.get(key, 0) + tokens
        cur, prev = batch.windows
        totals = {
            name: (self.counters.get(f"{name}:{cur}", 0), self.counters.get(f"{name}:{prev}", 0))
            for name in batch.reads
        }
        budgets.synced(batch, totals, replicas, now)


def connected(per_minute: int, replicas: int = 1) -> SharedBudgets:
    budgets = SharedBudgets(per_minute, sync_interval=0.2)
    budgets.synced(SyncBatch([], [], (0, -1)), {}, replicas, 0.0)
    return budgets


def test_one_process_admits_its_budget_then_refuses_until_the_minute_slides() -> None:
    budgets, redis = connected(1000), FakeRedis()
    now = 0.0
    admitted = 0
    while budgets.take("k", 100, now) == 0.0:
        admitted += 100
        now += 0.01
        redis.sync(budgets, budgets.batch(now), 1, now)
    assert admitted == 1000
    # All of it spent in this minute's first 0.1 s: the next minute must have slid 10% on.
    assert budgets.take("k", 100, now) == pytest.approx(WINDOW_S - now + 0.1 * WINDOW_S)
    assert budgets.take("other", 100, now) == 0.0  # keys do not share
    assert math.isinf(budgets.take("k", 1001, now))


def test_unsynced_usage_counts_at_once_and_completions_are_charged() -> None:
    budgets = connected(1000)
    assert budgets.take("k", 600, 0.1) == 0.0
    budgets.charge("k", 300, 0.1)
    assert budgets.take("k", 200, 0.1) > 0  # 600 + 300 + 200 > 1000, before any sync
    assert budgets.take("k", 100, 0.1) == 0.0
    (increment,) = budgets.batch(0.2).increments
    assert increment[1:] == (window_of(0.1), 1000)


def test_between_syncs_a_replica_admits_its_share_of_what_was_left_then_one_request() -> None:
    budgets, redis = connected(1200, replicas=4), FakeRedis()
    redis.sync(budgets, budgets.batch(0.0), 4, 0.0)
    # 1200 left, 4 replicas: 300 here until the next sync; a first request always may.
    assert budgets.take("k", 200, 0.05) == 0.0
    assert budgets.take("k", 100, 0.05) == 0.0
    assert budgets.take("k", 100, 0.05) == pytest.approx(0.2)  # wait for the next sync
    redis.sync(budgets, budgets.batch(0.2), 4, 0.2)
    assert budgets.take("k", 200, 0.25) == 0.0  # a new share: (1200 - 300) / 4


def flood(replicas: int, per_second: float, per_minute: int = 60_000) -> tuple[int, int]:
    """`replicas` syncing every 0.2 s (unaligned) while requests of 100-1,500 prompt tokens
    (and 50 completion tokens each) arrive at `per_second` for 30 s, all in one minute:
    (tokens admitted, tokens asked for in one sync interval on average)."""
    redis = FakeRedis()
    fleet = [connected(per_minute, replicas) for _ in range(replicas)]
    rng = random.Random(replicas)
    next_sync = [rng.uniform(0, 0.2) for _ in fleet]
    admitted = 0
    now = rng.expovariate(per_second)
    while now < 30.0:
        for i, member in enumerate(fleet):
            while next_sync[i] <= now:
                redis.sync(member, member.batch(next_sync[i]), replicas, next_sync[i])
                next_sync[i] += 0.2
        budgets = fleet[rng.randrange(replicas)]
        tokens = rng.randint(100, 1500)
        if budgets.take("k", tokens, now) == 0.0:
            budgets.charge("k", 50, now)
            admitted += tokens + 50
        now += rng.expovariate(per_second)
    return admitted, int(per_second * 0.2 * 850)


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_replicas_sharing_one_key_stay_within_a_tenth_of_its_budget(replicas: int) -> None:
    admitted, _ = flood(replicas, per_second=40.0)  # 30x the budget asked for
    assert 0.95 * 60_000 <= admitted <= 1.1 * 60_000


def test_a_flood_overshoots_by_at_most_about_what_one_sync_interval_asks_for() -> None:
    admitted, per_interval = flood(4, per_second=200.0)
    assert 60_000 <= admitted <= 60_000 + per_interval


def test_without_a_fresh_sync_each_process_falls_back_to_its_share() -> None:
    budgets, redis = connected(1000, replicas=4), FakeRedis()
    redis.sync(budgets, budgets.batch(0.0), 4, 0.0)
    now = budgets.stale_after + 1.0
    assert not budgets.connected(now)
    assert budgets.take("k", 200, now) == 0.0
    assert budgets.take("k", 50, now) == 0.0  # 250 = 1000 / 4
    assert budgets.take("k", 10, now) > 0
    # Redis back: what was used meanwhile is added, and the shared view admits again.
    batch = budgets.batch(now)
    assert sum(tokens for _, _, tokens in batch.increments) == 250
    redis.sync(budgets, batch, 4, now)
    assert budgets.connected(now)
    assert sum(redis.counters.values()) == 250
    assert budgets.take("k", 10, now) == 0.0


def test_a_request_larger_than_a_share_may_go_once_in_the_fallback() -> None:
    budgets = SharedBudgets(1000, local_replicas=4, shared=False)
    assert budgets.take("k", 400, 0.0) == 0.0  # more than 250, but nothing used yet
    assert budgets.take("k", 10, 0.0) > 0


def test_without_redis_workers_hold_a_share_each_and_nothing_is_kept_to_send() -> None:
    budgets = SharedBudgets(1000, local_replicas=2, shared=False)
    assert budgets.take("k", 500, 0.0) == 0.0
    assert budgets.take("k", 1, 0.0) > 0
    assert budgets.batch(0.0).increments == []


def test_keys_are_bounded_and_reads_per_sync_too() -> None:
    budgets = SharedBudgets(1000, max_keys=3)
    for key in range(10):
        budgets.take(f"key-{key}", 1, 0.0)
    assert len(budgets) == 3
    assert len(budgets.batch(0.0).reads) == 3
