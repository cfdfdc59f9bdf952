"""Tokens per minute per key, in one process. Pure: the caller passes `now`.

One bucket per key (the proxy's keys are (API key, model): a key's budget is per model, as
OpenAI's limits are), as deep as the tokens per minute the caller gives for that key,
refilled continuously. A request takes its prompt tokens up front; its completion tokens are
charged when the answer reports them, so a bucket may go below zero and the key then waits
longer (what a limiter on total tokens must do when output length is unknown in advance). At
most `max_keys` buckets live; the least recently used goes first (a forgotten key comes back
with a full bucket, as a new key would). Shared across processes: shared.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from app.errors import require_at_least


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
        require_at_least(1, max_keys=max_keys)
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
