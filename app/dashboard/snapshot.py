"""The dashboard's snapshot as a tree of types: what `/api/snapshot` and `/api/events` send,
and what `/api/schema` describes (schema.py). Each room declares the block it fills, beside
the code that fills it; this module puts them together, with what only the dashboard adds.

A proxy builds the whole snapshot (app/cli/sluice.py) from its rooms' snapshots; the feed
adds, for a page, the rates (`per_s`, `requests_per_s`, `l0_hit_pct`, ...), `window`,
`series` or `series_tail` and `dashboard`; the supervisor of `--workers N` sends the merge of
its workers' snapshots plus `workers`. The types are TypedDicts, not classes: the snapshot
stays the plain dicts that are serialised a few times a second, at no cost per request.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NotRequired, TypedDict

from app.budgets.shared import SharedBudgetsSnapshot
from app.budgets.sync import Notice, RedisBudgetsSnapshot
from app.dashboard.model_rows import ModelRow
from app.fleet.adapters import AdaptersBlock
from app.fleet.backend_row import BackendRow
from app.fleet.backends import Backend
from app.fleet.discoverer import SourceRow
from app.kv_events.subscriber import KvEventsSnapshot
from app.observe.admission_stats import AdmissionSnapshot
from app.observe.backend_stats import BackendTraffic
from app.observe.loop_monitor import LoopSnapshot
from app.observe.metric_summaries import TokenizeSummary
from app.observe.request_trace import RequestsSnapshot
from app.observe.stalls import HistogramSummary
from app.observe.timeseries import Series
from app.preprocess.pipeline import PreprocessSnapshot
from app.routing.router import RoutingSnapshot


class BackendView(BackendRow):
    """A backend in the snapshot's `backends` list: the pool's row, and what others know."""

    traffic: BackendTraffic
    kv_events: KvEventsSnapshot | None  # None: no --kv-events for it
    saturated: str | None  # why its engine has no room now (full, kv, ceiling)
    queued: int  # ours that may wait in its engine's queue
    held_with_room_s: float  # requests held while its engine reported room (kept at 0)
    adapters: AdaptersBlock  # its LoRA adapters


# Backends the page shows a row of: past this, a fleet's rows would cost the loop more than a
# tick may take (1,000 backends: 24 ms to build, 10 ms to serialise, 1 MB to every page each
# second), and no one reads a thousand rows. Each model's pool row still sums them all.
SHOWN_BACKENDS = 64


def shown_backends(members: Sequence[Backend], draining: Collection[Backend]) -> list[Backend]:
    """Those of `members` the page shows, in the pool's order: all when few; else those
    draining, then those that take no traffic, then the busiest."""
    if len(members) <= SHOWN_BACKENDS:
        return list(members)
    ranked = sorted(
        members,
        key=lambda b: (b not in draining, b.healthy and b.breaker_state(0.0) != "open", -b.load),
    )
    chosen = set(ranked[:SHOWN_BACKENDS])
    return [b for b in members if b in chosen]


def backend_view(
    row: BackendRow,
    traffic: BackendTraffic,
    kv_events: KvEventsSnapshot | None,
    saturated: str | None,
    queued: int,
    held_with_room_s: float,
    adapters: AdaptersBlock,
) -> BackendView:
    return {
        **row,
        "traffic": traffic,
        "kv_events": kv_events,
        "saturated": saturated,
        "queued": queued,
        "held_with_room_s": round(held_with_room_s, 6),
        "adapters": adapters,
    }


class Window(TypedDict):
    """Histograms of the last minute (None: nothing to show yet)."""

    seconds: float | None
    lag: HistogramSummary | None
    stalls: HistogramSummary | None
    tokenize: dict[str, HistogramSummary | None]  # by path


class FeedSettings(TypedDict):
    demo: bool  # `sluice demo`: the page offers a burst
    write_needs_token: bool
    tick_s: float
    longest_tick_s: float  # a page that hears nothing for longer has lost the feed
    history_points: int


class DashboardAbout(FeedSettings):
    pages: int  # listening now


class WorkerRow(TypedDict):
    index: int
    pid: int | None
    state: str  # starting, up, restarting, stopped
    incarnation: int
    up_s: float | None
    restarts: int
    last_exit: str | None
    last_exit_ago_s: float | None
    restart_in_s: float | None
    requests_total: int | None
    requests_per_s: float | None
    lag_max_recent_s: float | None
    stalls: float | None
    saturation: str | None
    dashboard: str | None  # its own dashboard's URL


class WorkersBlock(TypedDict):
    count: int
    up: int
    restarts: int
    rows: list[WorkerRow]


class Snapshot(TypedDict):
    """Times in seconds unless a name says `_ms`; None where nothing is known yet."""

    time: float  # Trio's clock
    wall_time: float  # Unix time
    policy: str  # the routing policy
    models: list[ModelRow]
    backends: list[BackendView]  # at most SHOWN_BACKENDS of them
    backends_total: int  # in the pool or draining
    routing: RoutingSnapshot
    preprocess: PreprocessSnapshot
    loop: LoopSnapshot
    tokenize: TokenizeSummary
    requests: RequestsSnapshot
    admission: AdmissionSnapshot
    budgets: RedisBudgetsSnapshot | SharedBudgetsSnapshot | None  # --redis-url, --workers
    notices: list[Notice]
    workers: NotRequired[WorkersBlock]  # --workers N: every other block is their sum
    discovery: NotRequired[list[SourceRow]]  # --discover-dns, --discover-k8s
    # Added by the feed for a page (not with `?counters=1`).
    window: NotRequired[Window]
    series: NotRequired[Series]  # a page's first snapshot: every point kept
    series_tail: NotRequired[Series]  # the next ones: the points since the one before
    dashboard: NotRequired[DashboardAbout]
