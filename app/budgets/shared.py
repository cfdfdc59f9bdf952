"""Per-key tokens-per-minute budgets shared by every process that enforces them. Pure.

With `--redis-url`, every worker and replica keeps counting locally and, every
`--budget-sync-interval`, adds the tokens it used since its last sync to one Redis counter per
key and minute (INCRBY) and reads back what all of them used (`BudgetSync` does the I/O;
nothing here touches Redis, a clock or Trio). A request is never held up by Redis: it is
admitted or refused from what this process knows now.

The budget is a sliding minute: what a key used in the current minute (by the wall clock, the
same windows on every replica) plus the previous minute's share that the window still covers,
`cur + prev * (1 - elapsed/60)`, must stay within its tokens per minute. Admission needs both:
- the global view: the total read at the last sync, plus what this process used since, plus
  the request, within the budget;
- this process's share of what was left at the last sync: at most `headroom / replicas` may
  be admitted here before the next sync (one request always may, if the global view allows),
  so the fleet's overshoot is bounded by what it admits in about one sync interval.
  Completion tokens (charged when the answer reports them) come on top, as in one process.

When Redis cannot be reached (no successful sync for `stale_after` seconds), each process
falls back to its own share: the budget divided by the replicas last seen in Redis (at least
the workers of this host), the safe side for a limit that protects capacity. A request is
refused by a budget, never failed by Redis. What a process used while Redis was away is added
once it is back (the current and previous minute's only). Without Redis but with
`--workers N`, each worker uses that same local share (1/N).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TypedDict

from app.errors import require_at_least

WINDOW_S = 60.0
# Keys whose counters one sync reads back: its cost stays bounded however many keys are busy.
MAX_READS_PER_SYNC = 256


def window_of(wall: float) -> int:
    return int(wall // WINDOW_S)


def sliding_total(counts: dict[int, int], wall: float) -> float:
    """The sliding minute ending at `wall`, from per-window counts."""
    window = window_of(wall)
    elapsed = (wall - window * WINDOW_S) / WINDOW_S
    return counts.get(window, 0) + counts.get(window - 1, 0) * (1.0 - elapsed)


def seconds_until_fits(counts: dict[int, int], wall: float, tokens: float, limit: float) -> float:
    """How long until `sliding_total + tokens <= limit` with no new usage (inf: never)."""
    if tokens > limit:
        return math.inf
    window = window_of(wall)
    cur, prev = counts.get(window, 0), counts.get(window - 1, 0)
    room = limit - tokens - cur
    if room >= 0:
        # prev * (1 - e) <= room: e >= 1 - room / prev.
        needed = 0.0 if prev <= room else 1.0 - room / prev
        return max(needed * WINDOW_S - (wall - window * WINDOW_S), 0.0)
    # Not before the next window, where this window's count becomes the sliding part.
    next_start = (window + 1) * WINDOW_S
    needed = 1.0 - (limit - tokens) / cur
    return next_start - wall + needed * WINDOW_S


def redis_name(prefix: str, key: Hashable) -> str:
    """The key's counters in Redis: a fingerprint (keys are API-key labels, never secrets,
    but a fingerprint also keeps every name short)."""
    return f"{prefix}{hashlib.sha256(repr(key).encode()).hexdigest()[:24]}"


class SharedBudgetsSnapshot(TypedDict):
    """The dashboard's `budgets` block, Redis or not."""

    shared: bool
    connected: bool
    replicas: int
    keys: int
    last_sync_age_s: float | None
    sync_interval_s: float


@dataclass
class _KeyState:
    name: str
    per_minute: int
    local: dict[int, int] = field(default_factory=dict)  # this process's usage by window
    pending: dict[int, int] = field(default_factory=dict)  # not yet added in Redis
    shared: dict[int, int] = field(default_factory=dict)  # every process's, as last read
    admitted_since_read: int = 0
    allowance: float = math.inf  # this process's share of the headroom, until the next read


def _add(counts: dict[int, int], window: int, tokens: int) -> None:
    counts[window] = counts.get(window, 0) + tokens
    for old in [w for w in counts if w < window - 1]:
        del counts[old]


@dataclass(frozen=True)
class SyncBatch:
    """What one sync sends: tokens to add per (name, window), names to read back."""

    increments: list[tuple[str, int, int]]
    reads: list[str]
    windows: tuple[int, int]  # (current, previous) window read back

    @property
    def empty(self) -> bool:
        return not self.increments and not self.reads


class SharedBudgets:
    """A layer over per-key budgets (`take`, `charge`, as `TokenBuckets`), shared by
    `replicas` processes; `per_minute` may differ per key and per call.

    Every `now` is the caller's clock (the proxy's: Trio's); `wall_offset` turns it into the
    wall clock that names the minutes in Redis (the sync sets it)."""

    def __init__(
        self,
        per_minute: int,
        *,
        local_replicas: int = 1,
        shared: bool = True,
        sync_interval: float = 0.2,
        prefix: str = "sluice:tpm:",
        max_keys: int = 10_000,
    ) -> None:
        require_at_least(1, local_replicas=local_replicas, max_keys=max_keys)
        self.per_minute = per_minute
        self.local_replicas = local_replicas
        self.shared = shared
        self.sync_interval = sync_interval
        # Without a successful sync for this long, the shared view is too old to admit by.
        self.stale_after = max(1.0, 5 * sync_interval)
        self.wall_offset = 0.0
        self.prefix = prefix
        self.max_keys = max_keys
        self.replicas_seen = local_replicas  # in Redis at the last sync
        self.last_sync: float | None = None
        self._keys: OrderedDict[Hashable, _KeyState] = OrderedDict()
        self._names: dict[str, Hashable] = {}
        self._read_cursor = 0

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def replicas(self) -> int:
        return max(self.replicas_seen, self.local_replicas)

    def connected(self, now: float) -> bool:
        """Whether the shared view is fresh enough to admit by."""
        return (
            self.shared and self.last_sync is not None and now - self.last_sync <= self.stale_after
        )

    def take(self, key: Hashable, tokens: int, now: float, per_minute: int | None = None) -> float:
        """0.0 when admitted (and counted), else seconds until it might be (inf: never)."""
        limit = per_minute or self.per_minute
        if tokens > limit:
            return math.inf
        state = self._state(key, limit)
        wall = now + self.wall_offset
        if not self.connected(now):
            # This process's share alone; one request may always use a share it left unused.
            share = limit / self.replicas
            if sliding_total(state.local, wall) == 0:
                share = max(share, tokens)
            wait = seconds_until_fits(state.local, wall, tokens, share)
        else:
            seen = dict(state.shared)
            for window, count in state.pending.items():
                seen[window] = seen.get(window, 0) + count
            wait = seconds_until_fits(seen, wall, tokens, limit)
            over_share = state.admitted_since_read + tokens > state.allowance
            if wait == 0.0 and over_share and state.admitted_since_read:
                wait = self.sync_interval  # the next sync brings a new share
        if wait > 0.0:
            return wait
        self._use(state, tokens, wall)
        state.admitted_since_read += tokens
        return 0.0

    def charge(self, key: Hashable, tokens: int, now: float, per_minute: int | None = None) -> None:
        """Tokens known only afterwards (the completion): counted, never refused."""
        state = self._state(key, per_minute or self.per_minute)
        self._use(state, tokens, now + self.wall_offset)

    def _use(self, state: _KeyState, tokens: int, wall: float) -> None:
        window = window_of(wall)
        _add(state.local, window, tokens)
        if self.shared:
            _add(state.pending, window, tokens)

    def _state(self, key: Hashable, per_minute: int) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            name = redis_name(self.prefix, key)
            # Until the first read: an equal share of a budget assumed untouched.
            state = self._keys[key] = _KeyState(
                name, per_minute, allowance=per_minute / self.replicas
            )
            self._names[name] = key
            if len(self._keys) > self.max_keys:
                _, gone = self._keys.popitem(last=False)
                self._names.pop(gone.name, None)
        else:
            self._keys.move_to_end(key)
            state.per_minute = per_minute
        return state

    def batch(self, now: float) -> SyncBatch:
        """What to send now: every key's pending usage, and a bounded round of keys to read
        (those with pending usage first)."""
        window = window_of(now + self.wall_offset)
        increments: list[tuple[str, int, int]] = []
        busy: list[str] = []
        idle: list[str] = []
        for state in self._keys.values():
            for w in [w for w in state.pending if w < window - 1]:
                del state.pending[w]  # a minute no longer counted by anyone
            for w, count in state.pending.items():
                increments.append((state.name, w, count))
            (busy if state.pending else idle).append(state.name)
        reads = busy[:MAX_READS_PER_SYNC]
        room = MAX_READS_PER_SYNC - len(reads)
        if room > 0 and idle:
            start = self._read_cursor % len(idle)
            rotated = idle[start:] + idle[:start]
            reads += rotated[:room]
            self._read_cursor = start + room
        return SyncBatch(increments, reads, (window, window - 1))

    def synced(
        self, batch: SyncBatch, totals: dict[str, tuple[int, int]], replicas: int, now: float
    ) -> None:
        """The batch was added in Redis; `totals`: by name, (current, previous) window's
        counts read back (the batch's own increments included); `replicas`: how many
        processes synced lately."""
        wall = now + self.wall_offset
        for name, window, count in batch.increments:
            key = self._names.get(name)
            state = self._keys.get(key) if key is not None else None
            if state is None:
                continue
            left = state.pending.get(window, 0) - count
            if left > 0:
                state.pending[window] = left
            else:
                state.pending.pop(window, None)
        current, previous = batch.windows
        for name, (cur, prev) in totals.items():
            key = self._names.get(name)
            state = self._keys.get(key) if key is not None else None
            if state is None:
                continue
            state.shared = {current: cur, previous: prev}
            headroom = max(state.per_minute - sliding_total(state.shared, wall), 0.0)
            state.admitted_since_read = 0
            state.allowance = headroom / max(replicas, self.local_replicas)
        self.replicas_seen = max(replicas, 1)
        self.last_sync = now

    def snapshot(self, now: float) -> SharedBudgetsSnapshot:
        return {
            "shared": self.shared,
            "connected": self.connected(now),
            "replicas": self.replicas,
            "keys": len(self._keys),
            "last_sync_age_s": None if self.last_sync is None else now - self.last_sync,
            "sync_interval_s": self.sync_interval,
        }
