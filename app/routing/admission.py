"""Token admission: tokens per minute per API key, and a bounded wait for a free backend.

`TokenBuckets` is pure (the caller passes `now`): one bucket per key (the proxy's keys are (API
key, model): a key's budget is per model, as OpenAI's limits are), as deep as the tokens per
minute the caller gives for that key, refilled continuously. A request takes its prompt tokens
up front; its completion tokens are charged when the answer reports them, so a bucket may go
below zero and the key then waits longer (what a limiter on total tokens must do when output
length is unknown in advance). At most `max_keys` buckets live; the least recently used goes
first (a forgotten key comes back with a full bucket, as a new key would).

`SlotQueue` is where requests wait when every backend of their model's pool already has
`--max-inflight-per-backend` requests (one queue per pool, so that a full pool never holds up
another's requests): at most `max_waiting` of them, each for at most `timeout` seconds, first
come first served; beyond either, the request is refused (429) instead of being held in memory.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

import trio


class Overloaded(Exception):
    """Refused for now: answer 429 with Retry-After."""

    def __init__(self, reason: str, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.reason = reason  # tokens_per_minute | request_too_large | queue_full | queue_timeout
        self.message = message
        self.retry_after = retry_after

    @property
    def retry_after_header(self) -> bytes:
        return str(max(1, math.ceil(self.retry_after))).encode()


@dataclass
class _Bucket:
    level: float
    updated: float
    capacity: float

    @property
    def rate(self) -> float:
        return self.capacity / 60.0


class TokenBuckets:
    def __init__(self, max_keys: int = 10_000) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.max_keys = max_keys
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: Hashable, tokens: int, now: float, per_minute: int) -> float:
        """Take `tokens` from the key's bucket, `per_minute` deep: 0.0 when admitted, else the
        seconds until they would be (nothing is taken then); `math.inf` when more than a
        whole minute's worth."""
        if tokens > per_minute:
            return math.inf
        bucket = self._refilled(key, now, per_minute)
        if bucket.level >= tokens:
            bucket.level -= tokens
            return 0.0
        return (tokens - bucket.level) / bucket.rate

    def charge(self, key: Hashable, tokens: int, now: float, per_minute: int) -> None:
        """Tokens known only afterwards (the completion): taken even below zero."""
        self._refilled(key, now, per_minute).level -= tokens

    def level(self, key: Hashable, now: float, per_minute: int) -> float:
        return self._refilled(key, now, per_minute).level

    def _refilled(self, key: Hashable, now: float, per_minute: int) -> _Bucket:
        if per_minute < 1:
            raise ValueError("a bucket holds at least one token a minute")
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(float(per_minute), now, float(per_minute))
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            elapsed = max(now - bucket.updated, 0.0)
            bucket.level = min(bucket.capacity, bucket.level + elapsed * bucket.rate)
            bucket.updated = now
        return bucket


class SlotQueue:
    def __init__(self, max_waiting: int, timeout: float) -> None:
        self.max_waiting = max_waiting
        self.timeout = timeout
        self._waiters: deque[trio.Event] = deque()
        self.rejected_full = 0
        self.rejected_timeout = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def wait(self, deadline: float, poll: float) -> None:
        """Wait until woken, `poll` seconds pass (the caller re-checks), or `deadline`.

        Raises `Overloaded` when the queue is full or the deadline passed.
        """
        now = trio.current_time()
        if now >= deadline:
            self.rejected_timeout += 1
            raise Overloaded(
                "queue_timeout",
                f"Every backend stayed at its in-flight limit for {self.timeout:g}s; "
                "try again later.",
                1.0,
            )
        if len(self._waiters) >= self.max_waiting:
            self.rejected_full += 1
            raise Overloaded(
                "queue_full",
                "Every backend is at its in-flight limit and the wait queue is full; "
                "try again later.",
                1.0,
            )
        woken = trio.Event()
        self._waiters.append(woken)
        try:
            with trio.move_on_at(min(deadline, now + poll)):
                await woken.wait()
        finally:
            if not woken.is_set():
                self._waiters.remove(woken)

    def wake_one(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()
