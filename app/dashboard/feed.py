"""The dashboard's heartbeat: one task that, once a tick, takes a snapshot, adds a point to
every time series and — only while a page is listening — serialises the snapshot once for
all of them, with only what came since the last tick: the request log's new records, and
the series' new points (`series_tail`). A page gets the whole log and the whole series
(`series`) once, when it connects. Measured: the whole series (~40 columns of 180 points)
cost 6 ms of the loop a tick to serialise, 132 KB to every page.

Pages never build anything: each waits for the next published payload (the same bytes for
every page); a slow page skips to the newest one, so nothing queues up behind it, and gets a
snapshot of its own then, with the whole log and series (the payloads it skipped had some). The
proxy's requests never wait for the dashboard either: recording a request is a few
microseconds on its own path (observe/request_trace.py), and everything here happens once
a tick, whatever the traffic. Occupancy gauges (threads, queue, fallback) keep their peak
between two reads, so a half-second burst still shows.

A tick is cut in slices (build, derive, serialise) with a checkpoint between them: under
`sluice demo`'s traffic a whole tick held the loop 5.7-5.9 ms. A quiet proxy (no request
asked for a backend since the tick before, none in flight) ticks every `QUIET_TICK_S`, and at
once when a request comes: measured with 4 backends and a page open, ticking every second was
~3 of an idle proxy's ~5 ms of CPU a second.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping

import trio

from app.dashboard.backends_api import MAX_BACKENDS
from app.dashboard.derive import HISTOGRAM_TICKS, decorate, derive_point, raw_sample
from app.dashboard.snapshot import FeedSettings, Snapshot
from app.fleet.traffic import TrafficSource
from app.models import MAX_MODELS
from app.observe.rate_limit import RateLimiter
from app.observe.request_log import RequestRecord
from app.observe.timeseries import Columns, CounterWindow

log = logging.getLogger("sluice.dashboard")

# The page's fixed series, one per backend and one per served model, at their bounds.
MAX_SERIES = 16 + MAX_BACKENDS + MAX_MODELS
# How often a quiet proxy ticks: what a page shows of it then changes little (health, the
# loop's lag), and the series' points carry their own time.
QUIET_TICK_S = 5.0

BuildSnapshot = Callable[[], Awaitable[Snapshot]]
# Gauges' maxima since the last call (read once a tick), so that short bursts still show.
ReadOccupancy = Callable[[], Mapping[str, float]]


class Broadcast:
    """The newest payload, numbered, and a way to wait for a newer one."""

    def __init__(self) -> None:
        self.version = 0
        self.published_at = -math.inf
        self._payload = b""
        self._changed = trio.Event()

    def publish(self, payload: bytes, now: float) -> None:
        self._payload = payload
        self.version += 1
        self.published_at = now
        self._changed.set()
        self._changed = trio.Event()

    async def newer_than(self, version: int) -> tuple[int, bytes]:
        while self.version <= version:
            await self._changed.wait()
        return self.version, self._payload


class RecordCache:
    """The request log serialised one record at a time, each once in its life: the log is
    most of a snapshot's bytes, and a record never changes once it is logged."""

    def __init__(self) -> None:
        self._by_seq: dict[int, bytes] = {}
        # Stands for the list in the rest of the snapshot; no client can guess it.
        self.placeholder = f"recent-{uuid.uuid4().hex}"

    def encode(self, records: list[RequestRecord], after: int = 0) -> bytes:
        """The records (newest first) as a JSON list, those up to seq `after` left out."""
        kept: dict[int, bytes] = {}
        for record in records:
            seq = record["seq"]
            kept[seq] = self._by_seq.get(seq) or to_json_bytes(record)
        self._by_seq = kept  # bounded by the log's own capacity
        return b"[" + b",".join(v for seq, v in kept.items() if seq > after) + b"]"

    def serialise(self, snapshot: Snapshot, after: int = 0) -> bytes:
        """`to_json_bytes(snapshot)`, the request log spliced in from the cache: its records
        newer than seq `after` (a page has the rest; `requests.oldest_seq` says which of
        them it may drop)."""
        requests = snapshot["requests"]
        recent = requests["recent"]
        # Shallow copies: the snapshot itself keeps its records.
        text = to_json_bytes({**snapshot, "requests": {**requests, "recent": self.placeholder}})
        return text.replace(f'"{self.placeholder}"'.encode(), self.encode(recent, after), 1)


def to_json_bytes(snapshot: Mapping[str, object]) -> bytes:
    """Strict JSON (a browser's JSON.parse refuses NaN): non-finite numbers become null."""
    try:
        text = json.dumps(snapshot, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(snapshot), separators=(",", ":"), allow_nan=False)
    return text.encode()


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


class DashboardFeed:
    """Run `run` in the main nursery; pages iterate `pages_events`, `/api/snapshot` calls
    `snapshot`, a write calls `poke`."""

    def __init__(
        self,
        build: BuildSnapshot,
        occupancy: ReadOccupancy,
        *,
        demo: bool,
        write_needs_token: bool,
        traffic: TrafficSource | None = None,
        tick_s: float = 1.0,
        history_points: int = 180,
        max_pages: int = 32,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._build = build
        self._occupancy = occupancy
        # None (a supervisor's merged view): tick every `tick_s` whatever the traffic.
        self._traffic = traffic
        self.tick_s = tick_s
        # What a page is told of the proxy and this feed, besides how many pages listen.
        self._about: FeedSettings = {
            "demo": demo,
            "write_needs_token": write_needs_token,
            "tick_s": tick_s,
            # A page that hears nothing for longer than this has lost the feed.
            "longest_tick_s": tick_s if traffic is None else QUIET_TICK_S,
            "history_points": history_points,
        }
        self.max_pages = max_pages
        self._wall_clock = wall_clock
        self._window = CounterWindow(HISTOGRAM_TICKS)
        self._columns = Columns(history_points, max_columns=MAX_SERIES)
        self._broadcast = Broadcast()
        self._records = RecordCache()
        self._published_seq = 0  # the newest record a published payload carried
        self._published_points = 0  # the series' points appended when it was published
        self._poked = trio.Event()
        self._error_reports = RateLimiter(1, 60.0)
        self.pages = 0

    def _complete(self, snapshot: Snapshot, series_since: int | None = None) -> Snapshot:
        """The snapshot as a page gets it: with the whole series, or (`series_since`, a count
        of points appended) only the points appended since then, as `series_tail`."""
        decorate(snapshot, self._window)
        columns = self._columns
        if series_since is None:
            snapshot["series"] = columns.to_json()
        else:
            snapshot["series_tail"] = columns.tail(columns.appended - series_since)
        snapshot["dashboard"] = {**self._about, "pages": self.pages}
        return snapshot

    def poke(self) -> None:
        """Publish a fresh snapshot now rather than at the next tick (a policy changed)."""
        self._poked.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        next_tick = trio.current_time()
        seen = -1  # the traffic's request count at the last tick
        while True:
            now = trio.current_time()
            if now >= next_tick:
                ticked_at = now
                await self._guarded(self._tick)
                quiet = self._quiet_since(seen)
                seen = self._traffic.requests if self._traffic is not None else 0
                next_tick = max(next_tick + (QUIET_TICK_S if quiet else self.tick_s), now)
                if quiet and await self._wait_for_request(next_tick):
                    next_tick = max(ticked_at + self.tick_s, trio.current_time())
            with trio.move_on_at(next_tick):
                await self._poked.wait()
            if self._poked.is_set():
                self._poked = trio.Event()
                if self.pages:
                    await self._guarded(self._publish_now)

    def _quiet_since(self, seen: int) -> bool:
        traffic = self._traffic
        return traffic is not None and traffic.requests == seen and not traffic.busy

    async def _wait_for_request(self, deadline: float) -> bool:
        """Until `deadline`, a request or a poke; whether a request came."""
        traffic = self._traffic
        assert traffic is not None
        came = False

        async def request_came(cancel_scope: trio.CancelScope) -> None:
            nonlocal came
            await traffic.next_request()
            came = True
            cancel_scope.cancel()

        async def poked(cancel_scope: trio.CancelScope) -> None:
            await self._poked.wait()
            cancel_scope.cancel()

        with trio.move_on_at(deadline):
            async with trio.open_nursery() as waiting:
                waiting.start_soon(request_came, waiting.cancel_scope)
                waiting.start_soon(poked, waiting.cancel_scope)
        return came

    async def pages_events(self) -> AsyncGenerator[bytes, None]:
        """What one page receives: the current snapshot at once (the whole request log and
        series), then one a tick (what came since the tick before).

        Ends at once if the page limit was reached in the meantime.
        """
        if self.pages >= self.max_pages:
            return
        self.pages += 1
        try:
            # Its own first snapshot, with the whole request log; then the shared payloads,
            # each with the records that came since the one before.
            version = self._broadcast.version
            yield await self.snapshot_bytes()
            while True:
                newest, payload = await self._broadcast.newer_than(version)
                if newest > version + 1:  # it read too slowly for some: their records too
                    payload = await self.snapshot_bytes()
                version = newest
                yield payload
        finally:
            self.pages -= 1

    async def snapshot_bytes(self, *, counters: bool = False, records_after: int = 0) -> bytes:
        """A fresh snapshot as JSON, built in slices: a page's first, and `/api/snapshot`'s
        answer (`counters`: as built, without the rates, series and histograms this feed
        derives, which a supervisor derives from its workers' sum; `records_after`: the
        request log's records after that seq only). In one piece, under `sluice demo`'s
        traffic, the whole series and log held the loop ~11 ms."""
        snapshot = await self._build()
        await trio.lowlevel.checkpoint()
        if not counters:
            self._complete(snapshot)
            await trio.lowlevel.checkpoint()
        return self._records.serialise(snapshot, records_after)

    async def _tick(self) -> None:
        snapshot = await self._build()
        await trio.lowlevel.checkpoint()
        self._window.push(trio.current_time(), raw_sample(snapshot, self._occupancy()))
        point = {k: _rounded(v) for k, v in derive_point(self._window, snapshot).items()}
        self._columns.append(round(self._wall_clock(), 3), point)
        if self.pages:
            await trio.lowlevel.checkpoint()
            self._publish(snapshot)

    async def _publish_now(self) -> None:
        self._publish(await self._build())

    def _publish(self, snapshot: Snapshot) -> None:
        """The payload every page gets: what came since the last one."""
        self._complete(snapshot, self._published_points)
        payload = self._records.serialise(snapshot, self._published_seq)
        self._published_seq = snapshot["requests"]["total"]
        self._published_points = self._columns.appended
        self._broadcast.publish(payload, trio.current_time())

    async def _guarded(self, step: Callable[[], Awaitable[None]]) -> None:
        """A bug in a snapshot must cost the page a tick, never the proxy its nursery."""
        try:
            await step()
        except Exception:
            if self._error_reports.admit(time.monotonic()) is not None:
                log.exception("dashboard feed: a tick failed (at most one report a minute)")


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
