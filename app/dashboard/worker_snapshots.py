"""The snapshots of `sluice serve --workers N`, merged into the one the page reads. Pure.

Every worker answers its own `/api/snapshot`; the supervisor's dashboard shows their sum in
the same shape, so every panel reads it unchanged, plus a `workers` block with one row per
worker. `merge_snapshots` walks the snapshots together, key by key, and needs no list of
fields to stay correct as snapshots grow:

- numbers are counts (requests, hits, blocks, threads busy, ...) and are added, except the
  keys in `SAME` (settings and the backends' own reports, alike in every worker: the first
  is kept) and `WORST` (the worst of the workers: p99s, maxima, last times);
- a histogram (a dict with `buckets`) is merged bucket by bucket, its p50 and p99 computed
  again from the merged counts;
- lists of backends are merged by URL, of models by name; stall records are pooled, newest
  first, each tagged with its worker; other lists, strings and flags are the first worker's;
- a model's saturation is made again from its merged parts, as the supervisor's /metrics
  makes it (app/observe/saturation_signal.py, rule 3): the largest engines-saturated ratio
  plus every worker's held requests over the room, never a sum of the workers' figures.

The request log is merged by `RecordLog`, which numbers records in the order the supervisor
first sees them, so that `seq` keeps rising across workers and their restarts (the page adds
rows by `seq`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import cast

from app.dashboard.snapshot import Snapshot
from app.observe.request_log import RequestRecord
from app.observe.saturation_signal import saturation
from app.observe.stalls import StallRecord, summarize_histogram

# The merge walks the snapshots as plain JSON (any key, any value); its result has their shape.
JsonObject = Mapping[str, object]

# Settings, the backends' own reports and the engines' (read by every worker alike).
SAME = frozenset(
    {
        "time",
        "wall_time",
        "threshold_ms",
        "probe_interval_ms",
        "max_recent_window_s",
        "capacity",
        "max_entries",
        "max_bytes",
        "max_text_bytes",
        "queue_limit",
        "block_size",
        "max_blocks",
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "max_inflight_per_backend",
        "max_waiting",
        "tokens_per_minute",
        "ttft_window_s",
        "max_model_len",
        "max_lora",
        "base_seconds",
        "budget_seconds",
        "per_char_seconds",
        "per_message_seconds",
        "reported_kv_usage",
        "reported_waiting",
        "others_inflight",
        "others_per_own",
        "load",
        "consecutive_failures",
        "joined_ago",
        "backends_total",
        "sync_interval_s",
        "replicas",
        # A model's pool, as every worker sees it.
        "healthy_backends",
        "serving_backends",
        "engine_running",
        "engine_waiting",
        "engine_kv_cache_usage",
        "engine_prefix_cache_hit_rate",
        # Admission: an API key's weight, the window's length, a model's room.
        "weight",
        "window_s",
        "room",
    }
)
# Lists of entries merged entry by entry, by this field.
MERGED_BY = {"backends": "url", "models": "name"}
# Blocks whose every number is the same thing seen by each worker (one engine, one Redis);
# an engine's room is each worker's judgement of one engine: the first worker's is shown.
SAME_BLOCKS = frozenset({"engine", "kv_events", "budgets", "room"})
WORST = frozenset(
    {
        "p99",
        "max_recent",
        "max_duration_s",
        "last_duration_s",
        "last_time",
        "first_time",
        "engines_saturated_ratio",
        "oldest_held_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "last_lag_s",
        "mean_predicted_hit",
        "mean_reported_hit",
        "breakers_open",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "wait_p50_s",
        "wait_p99_s",
        "prefill_p50_ms",
        "prefill_p99_ms",
        "draining_for",
    }
)
STALLS_SHOWN = 20
SUMMARY_KEYS = frozenset({"buckets", "count", "sum", "p50", "p99"})


def merge_snapshots(snapshots: Sequence[Snapshot]) -> Snapshot:
    """One snapshot of the same shape as each of `snapshots` (at least one)."""
    merged = cast(Snapshot, _merge_dicts(list(snapshots)))
    stalls: list[StallRecord] = [
        {**stall, "worker": index}
        for index, snapshot in enumerate(snapshots)
        for stall in snapshot.get("loop", {}).get("recent", ())
    ]
    if "loop" in merged:
        stalls.sort(key=lambda stall: stall.get("last_time") or 0.0, reverse=True)
        merged["loop"]["recent"] = stalls[:STALLS_SHOWN]
    for model in merged.get("admission", {}).get("models", {}).values():
        model["saturation"] = saturation(
            model["engines_saturated_ratio"], model["held"], model["room"]
        )
    return merged


def _merge_value(key: str, values: list[object]) -> object:
    first = values[0]
    if isinstance(first, Mapping):
        dicts = [v for v in values if isinstance(v, Mapping)]
        if key in SAME_BLOCKS:
            return dict(first)
        if isinstance(first.get("buckets"), list):
            return _merge_histogram(dicts)
        return _merge_dicts(dicts)
    if isinstance(first, list):
        if key in MERGED_BY:
            return _merge_by(MERGED_BY[key], [v for v in values if isinstance(v, list)])
        return first
    if isinstance(first, bool) or not isinstance(first, int | float):
        return next((v for v in values if v is not None), first)
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if key in SAME:
        return first
    if key in WORST:
        return max(numbers)
    return sum(numbers)


def _merge_dicts(dicts: Sequence[JsonObject]) -> dict[str, object]:
    keys = list(OrderedDict.fromkeys(key for d in dicts for key in d))
    merged: dict[str, object] = {}
    for key in keys:
        values = [d[key] for d in dicts if key in d]
        present = [v for v in values if v is not None]
        merged[key] = _merge_value(key, present) if present else None
    return merged


def _merge_by(field: str, lists: list[list[object]]) -> list[dict[str, object]]:
    by_field: OrderedDict[object, list[JsonObject]] = OrderedDict()
    for entries in lists:
        for entry in entries:
            if isinstance(entry, Mapping) and field in entry:
                by_field.setdefault(entry[field], []).append(entry)
    return [_merge_dicts(entries) for entries in by_field.values()]


def _bucket_edges_and_counts(histogram: JsonObject) -> tuple[list[object], list[float]]:
    buckets = histogram["buckets"]
    assert isinstance(buckets, list)
    edges: list[object] = []
    counts: list[float] = []
    for bucket in buckets:
        assert isinstance(bucket, Mapping)
        edges.append(bucket["le"])
        count = bucket["count"]
        counts.append(float(count) if isinstance(count, int | float) else 0.0)
    return edges, counts


def _merge_histogram(histograms: list[JsonObject]) -> dict[str, object]:
    """Bucket counts added; count, sum, p50 and p99 from them; other keys as any dict's."""
    read = [_bucket_edges_and_counts(h) for h in histograms]
    edges = read[0][0]
    if any(other != edges for other, _ in read):
        return dict(histograms[0])  # different bounds cannot be added (never expected)
    counts = [sum(each[i] for _, each in read) for i in range(len(edges))]
    cumulative: list[float] = []
    for count in counts:
        cumulative.append((cumulative[-1] if cumulative else 0.0) + count)
    bounds = [float(edge) for edge in edges if isinstance(edge, int | float)]
    if len(cumulative) != len(bounds) + 1:
        return dict(histograms[0])
    others = _merge_dicts(
        [{k: v for k, v in h.items() if k not in SUMMARY_KEYS} for h in histograms]
    )
    total = sum(_number(h.get("sum")) for h in histograms)
    return {**others, **summarize_histogram(bounds, cumulative, total)}


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


class RecordLog:
    """The workers' request logs as one, newest first, numbered by the supervisor."""

    def __init__(self, capacity: int = 200) -> None:
        self.capacity = capacity
        self._seq = 0
        self._shown: deque[RequestRecord] = deque(maxlen=capacity)  # oldest first
        # The newest seq taken from each (worker, incarnation): a restarted worker counts
        # from 1 again under a new incarnation.
        self._taken: dict[tuple[int, int], int] = {}

    def update(self, worker: int, incarnation: int, recent: Sequence[RequestRecord]) -> None:
        """Take a worker's `requests.recent` (newest first); new records get the next seqs."""
        source = (worker, incarnation)
        taken = self._taken.get(source, 0)
        for record in reversed(recent):
            seq = record["seq"]
            if seq <= taken:
                continue
            taken = seq
            self._seq += 1
            self._shown.append({**record, "seq": self._seq, "worker": worker})
        self._taken[source] = taken

    def taken(self, worker: int, incarnation: int) -> int:
        """The newest seq taken from that worker's incarnation (0: none yet)."""
        return self._taken.get((worker, incarnation), 0)

    def forget(self, worker: int, incarnation: int) -> None:
        """That incarnation of the worker has exited: nothing more will come from it."""
        self._taken.pop((worker, incarnation), None)

    def recent(self) -> list[RequestRecord]:
        return list(reversed(self._shown))
