"""The engines' KV events as Prometheus metrics, read from the subscribers at scrape time.

The subscribers count everything once, for the dashboard's snapshot too
(`KvEventSubscriber.snapshot`); this collector turns those snapshots into series when
/metrics is scraped, so nothing is counted twice and the event path pays nothing for it.
Every label value that can occur is written from the start (zeros included), so rates and
alerts need no "absent" case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

EVENT_KINDS = ("stored", "removed", "cleared", "other")
BLOCK_OUTCOMES = ("learned", "confirmed", "removed", "unknown", "unmapped", "skipped")
GAP_OUTCOMES = ("replayed", "rebuilt")
SOURCES = ("events", "predicted")

Snapshots = Callable[[], Mapping[str, Mapping[str, Any]]]


class KvEventCollector:
    def __init__(self, snapshots: Snapshots) -> None:
        """`snapshots()`: by backend URL, each subscriber's `snapshot`."""
        self._snapshots = snapshots

    def describe(self) -> list[Metric]:
        return []  # the names are fixed above; nothing to collect at registration

    def collect(self) -> Iterator[Metric]:
        snapshots = self._snapshots()
        batches = CounterMetricFamily(
            "sluice_kv_events_batches",
            "KV event messages (one engine step each) applied to the prefix index",
            labels=["backend"],
        )
        applied = CounterMetricFamily(
            "sluice_kv_events_applied",
            "KV events applied, by type (stored, removed, cleared, other)",
            labels=["backend", "type"],
        )
        blocks = CounterMetricFamily(
            "sluice_kv_events_blocks",
            "Blocks in KV events, by outcome: learned (new to the index), confirmed (predicted "
            "already), removed, unknown (removal of a block never seen), unmapped (stored under "
            "a parent never seen), skipped (another medium, a LoRA adapter, extra keys)",
            labels=["backend", "outcome"],
        )
        gaps = CounterMetricFamily(
            "sluice_kv_events_gaps",
            "Sequence gaps, by outcome: replayed, or rebuilt (the backend's index cleared)",
            labels=["backend", "outcome"],
        )
        restarts = CounterMetricFamily(
            "sluice_kv_events_restarts",
            "Times an engine's sequence numbers went back (a restart): its index cleared",
            labels=["backend"],
        )
        bad = CounterMetricFamily(
            "sluice_kv_events_bad_messages",
            "KV event messages that could not be decoded, dropped",
            labels=["backend"],
        )
        lag = GaugeMetricFamily(
            "sluice_kv_events_lag_seconds",
            "From the engine's timestamp of the last batch to its application here",
            labels=["backend"],
        )
        source = GaugeMetricFamily(
            "sluice_kv_events_source",
            "1 for what the backend's prefix index stands on now: events, or predicted "
            "(no event yet, or the publisher silent while requests flow)",
            labels=["backend", "source"],
        )
        mapped = GaugeMetricFamily(
            "sluice_kv_events_mapped_blocks",
            "Engine blocks followed (engine hash -> Sluice chain), bounded by --max-index-blocks",
            labels=["backend"],
        )
        for url, snap in snapshots.items():
            batches.add_metric([url], snap["batches"])
            for kind in EVENT_KINDS:
                applied.add_metric([url, kind], snap["events"].get(kind, 0))
            for outcome in BLOCK_OUTCOMES:
                blocks.add_metric([url, outcome], snap["blocks"].get(outcome, 0))
            for outcome in GAP_OUTCOMES:
                gaps.add_metric([url, outcome], snap["gaps"].get(outcome, 0))
            restarts.add_metric([url], snap["restarts"])
            bad.add_metric([url], snap["bad_messages"])
            if snap["last_lag_s"] is not None:
                lag.add_metric([url], snap["last_lag_s"])
            for name in SOURCES:
                source.add_metric([url, name], 1.0 if snap["source"] == name else 0.0)
            mapped.add_metric([url], snap["mapped_blocks"])
        yield from (batches, applied, blocks, gaps, restarts, bad, lag, source, mapped)
