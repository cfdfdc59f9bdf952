"""The shared budgets' one contact with Redis: a batch every `--budget-sync-interval`.

Each sync is one pipelined round trip, run by redis-py in a worker thread (never on the
loop): INCRBY of every key's tokens used since the last sync on its counter for that minute
(`sluice:tpm:<fingerprint>:<minute>`, expiring after two minutes), MGET of the current and
previous minute's counters of the keys read back, and the replicas' roll call (a sorted set
of replica ids by their last sync, stale ones dropped). Requests never wait for it; if Redis
is slow or gone, the sync fails after `timeout`, `SharedBudgets` falls back to local shares,
`sluice_budget_redis_up` drops to 0 and the dashboard says so.

Why redis-py in a thread rather than RESP spoken over Trio streams: it parses every form of
`--redis-url` (passwords, ACL users, database numbers, TLS, unix sockets) and reconnects on
its own, and one thread hop per sync (5 a second) costs nothing next to a request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal, TypedDict
from urllib.parse import urlsplit

import redis
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.budgets.shared import WINDOW_S, SharedBudgets, SharedBudgetsSnapshot, SyncBatch
from app.observe.metrics import ReadAtScrape

log = logging.getLogger("sluice.budgets")

REPLICAS_KEY = "sluice:tpm:replicas"
COUNTER_TTL_S = int(2 * WINDOW_S) + 10


def safe_url(url: str) -> str:
    """The URL without its password, for logs and the page."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return parts._replace(netloc=user + netloc).geturl()


class Notice(TypedDict):
    """What the dashboard's banner shows (`notices`)."""

    level: Literal["warning", "error"]
    text: str


class RedisBudgetsSnapshot(SharedBudgetsSnapshot):
    redis: str  # its URL, password hidden
    redis_up: bool
    syncs: dict[str, int]  # ok, error
    last_error: str | None


class RedisCounters:
    """The blocking half, run in a worker thread."""

    def __init__(self, url: str, timeout: float) -> None:
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def sync(
        self, batch: SyncBatch, wall: float, replica_ttl: float
    ) -> tuple[dict[str, tuple[int, int]], int]:
        pipe = self.client.pipeline(transaction=False)
        for name, window, tokens in batch.increments:
            counter = f"{name}:{window}"
            pipe.incrby(counter, tokens)
            pipe.expire(counter, COUNTER_TTL_S)
        current, previous = batch.windows
        if batch.reads:
            pipe.mget([f"{name}:{w}" for name in batch.reads for w in (current, previous)])
        pipe.zadd(REPLICAS_KEY, {self.replica: wall})
        pipe.zremrangebyscore(REPLICAS_KEY, "-inf", wall - replica_ttl)
        pipe.zcard(REPLICAS_KEY)
        pipe.expire(REPLICAS_KEY, COUNTER_TTL_S)
        results: list[Any] = pipe.execute()
        totals: dict[str, tuple[int, int]] = {}
        if batch.reads:
            values = results[2 * len(batch.increments)]
            for i, name in enumerate(batch.reads):
                totals[name] = (int(values[2 * i] or 0), int(values[2 * i + 1] or 0))
        return totals, int(results[-2])

    def leave(self) -> None:
        """Off the roll call at once, so the others' shares grow back without waiting."""
        self.client.zrem(REPLICAS_KEY, self.replica)
        self.client.close()


class BudgetSync:
    def __init__(self, budgets: SharedBudgets, url: str, timeout: float = 0.5) -> None:
        self.budgets = budgets
        self.url = url
        self.shown_url = safe_url(url)
        self.timeout = timeout
        self.syncs = {"ok": 0, "error": 0}
        self.last_error: str | None = None
        self.down_since: float | None = None  # wall clock
        self._limiter = trio.CapacityLimiter(1)

    @property
    def replica_ttl(self) -> float:
        return max(5.0, 10 * self.budgets.sync_interval)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        counters = await trio.to_thread.run_sync(RedisCounters, self.url, self.timeout)
        task_status.started()
        try:
            next_sync = trio.current_time()
            while True:
                await self.sync_once(counters)
                next_sync = max(next_sync + self.budgets.sync_interval, trio.current_time())
                await trio.sleep_until(next_sync)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.timeout):
                await trio.to_thread.run_sync(
                    _leave_quietly, counters, abandon_on_cancel=True, limiter=self._limiter
                )

    async def sync_once(self, counters: RedisCounters) -> None:
        budgets = self.budgets
        now, wall = trio.current_time(), time.time()
        budgets.wall_offset = wall - now
        batch = budgets.batch(now)
        try:
            totals, replicas = await trio.to_thread.run_sync(
                counters.sync,
                batch,
                wall,
                self.replica_ttl,
                abandon_on_cancel=True,
                limiter=self._limiter,
            )
        except (redis.RedisError, OSError) as exc:
            self.syncs["error"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            if self.down_since is None:
                self.down_since = wall
                log.warning(
                    "Redis at %s unreachable (%s): per-key budgets fall back to local shares "
                    "(1/%d of each budget) until it is back",
                    self.shown_url,
                    self.last_error,
                    budgets.replicas,
                )
            return
        budgets.synced(batch, totals, replicas, trio.current_time())
        self.syncs["ok"] += 1
        if self.down_since is not None:
            log.warning(
                "Redis at %s is back after %.1fs: per-key budgets are shared again",
                self.shown_url,
                wall - self.down_since,
            )
            self.down_since = None
            self.last_error = None

    @property
    def up(self) -> bool:
        return self.budgets.connected(trio.current_time())

    def snapshot(self) -> RedisBudgetsSnapshot:
        return {
            **self.budgets.snapshot(trio.current_time()),
            "redis": self.shown_url,
            "redis_up": self.up,
            "syncs": dict(self.syncs),
            "last_error": self.last_error,
        }

    def notices(self) -> list[Notice]:
        if self.up:
            return []
        since = (
            ""
            if self.down_since is None
            else f" since {time.strftime('%H:%M:%S', time.localtime(self.down_since))}"
        )
        return [
            {
                "level": "warning",
                "text": f"Redis at {self.shown_url} unreachable{since}: per-key budgets are "
                f"local, each process admits 1/{self.budgets.replicas} of a key's budget",
            }
        ]


def _leave_quietly(counters: RedisCounters) -> None:
    with contextlib.suppress(redis.RedisError, OSError):
        counters.leave()


class BudgetCollector(ReadAtScrape):
    """`sluice_budget_*` at scrape time, from the sync's own counts."""

    def __init__(self, sync: BudgetSync) -> None:
        self.sync = sync

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "sluice_budget_redis_up",
            "1 while per-key budgets are shared through Redis, 0 while they fall back to "
            "local shares",
        )
        up.add_metric([], 1.0 if self.sync.up else 0.0)
        yield up
        syncs = CounterMetricFamily(
            "sluice_budget_syncs", "Syncs of the shared budgets with Redis", labels=["outcome"]
        )
        for outcome, count in self.sync.syncs.items():
            syncs.add_metric([outcome], float(count))
        yield syncs
        replicas = GaugeMetricFamily(
            "sluice_budget_replicas", "Processes sharing the budgets, as last seen in Redis"
        )
        replicas.add_metric([], float(self.sync.budgets.replicas))
        yield replicas
