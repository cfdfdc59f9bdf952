"""Token admission: tokens per minute per API key, and a bounded wait for a free backend.

`TokenBuckets` is pure (the caller passes `now`): one bucket per key, `tokens_per_minute`
deep, refilled continuously. A request takes its prompt tokens up front; its completion
tokens are charged when the answer reports them, so a bucket may go below zero and the key
then waits longer (what a limiter on total tokens must do when output length is unknown in
advance). At most `max_keys` buckets live; the least recently used goes first (a forgotten
key comes back with a full bucket, as a new key would).

`SlotQueue` is where requests wait when every backend already has `--max-inflight-per-backend`
requests: at most `max_waiting` of them, each for at most `timeout` seconds, first come first
served; beyond either, the request is refused (429) instead of being held in memory.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
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


class TokenBuckets:
    def __init__(self, tokens_per_minute: int, max_keys: int = 10_000) -> None:
        if tokens_per_minute < 1 or max_keys < 1:
            raise ValueError("tokens_per_minute and max_keys must be at least 1")
        self.capacity = float(tokens_per_minute)
        self.rate = tokens_per_minute / 60.0
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str, tokens: int, now: float) -> float:
        """Take `tokens` from the key's bucket: 0.0 when admitted, else the seconds until they
        would be (nothing is taken then); `math.inf` when more than a whole minute's worth."""
        if tokens > self.capacity:
            return math.inf
        bucket = self._refilled(key, now)
        if bucket.level >= tokens:
            bucket.level -= tokens
            return 0.0
        return (tokens - bucket.level) / self.rate

    def charge(self, key: str, tokens: int, now: float) -> None:
        """Tokens known only afterwards (the completion): taken even below zero."""
        self._refilled(key, now).level -= tokens

    def level(self, key: str, now: float) -> float:
        return self._refilled(key, now).level

    def _refilled(self, key: str, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.capacity, now)
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            elapsed = max(now - bucket.updated, 0.0)
            bucket.level = min(self.capacity, bucket.level + elapsed * self.rate)
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
