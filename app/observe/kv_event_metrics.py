"""The engines' KV events as Prometheus metrics, read from the subscribers at scrape time.

The subscribers count everything once, for the dashboard's snapshot too
(`KvEventSubscriber.snapshot`); this collector turns those snapshots into series when
/metrics is scraped, so nothing is counted twice and the event path pays nothing for it.
Every label value that can occur is written from the start (zeros included), so rates and
alerts need no "absent" case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.observe.metrics import ReadAtScrape

EVENT_KINDS = ("stored", "removed", "cleared", "other")
BLOCK_OUTCOMES = ("learned", "confirmed", "removed", "unknown", "unmapped", "skipped")
GAP_OUTCOMES = ("replayed", "rebuilt")
SOURCES = ("events", "predicted")

# By backend URL, each subscriber's `snapshot` (app/kv_events/subscriber.py's KvEventsSnapshot).
Snapshots = Callable[[], Mapping[str, Mapping[str, object]]]
Family = type[CounterMetricFamily] | type[GaugeMetricFamily]

# Each series: its name and help, its kind, the snapshot key it reads, and the label it spreads
# over with every value that label takes (None: one series per backend; a None value: none).
SERIES: tuple[tuple[str, str, Family, str, tuple[str, tuple[str, ...]] | None], ...] = (
    (
        "sluice_kv_events_batches",
        "KV event messages (one engine step each) applied to the prefix index",
        CounterMetricFamily,
        "batches",
        None,
    ),
    (
        "sluice_kv_events_applied",
        "KV events applied, by type (stored, removed, cleared, other)",
        CounterMetricFamily,
        "events",
        ("type", EVENT_KINDS),
    ),
    (
        "sluice_kv_events_blocks",
        "Blocks in KV events, by outcome: learned (new to the index), confirmed (predicted "
        "already), removed, unknown (removal of a block never seen), unmapped (stored under "
        "a parent never seen), skipped (another medium, a LoRA adapter, extra keys)",
        CounterMetricFamily,
        "blocks",
        ("outcome", BLOCK_OUTCOMES),
    ),
    (
        "sluice_kv_events_gaps",
        "Sequence gaps, by outcome: replayed, or rebuilt (the backend's index cleared)",
        CounterMetricFamily,
        "gaps",
        ("outcome", GAP_OUTCOMES),
    ),
    (
        "sluice_kv_events_restarts",
        "Times an engine's sequence numbers went back (a restart): its index cleared",
        CounterMetricFamily,
        "restarts",
        None,
    ),
    (
        "sluice_kv_events_bad_messages",
        "KV event messages that could not be decoded, dropped",
        CounterMetricFamily,
        "bad_messages",
        None,
    ),
    (
        "sluice_kv_events_lag_seconds",
        "From the engine's timestamp of the last batch to its application here",
        GaugeMetricFamily,
        "last_lag_s",
        None,
    ),
    (
        "sluice_kv_events_mapped_blocks",
        "Engine blocks followed (engine hash -> Sluice chain), bounded by --max-index-blocks",
        GaugeMetricFamily,
        "mapped_blocks",
        None,
    ),
)
SOURCE_HELP = (
    "1 for what the backend's prefix index stands on now: events, or predicted "
    "(no event yet, or the publisher silent while requests flow)"
)


class KvEventCollector(ReadAtScrape):
    def __init__(self, snapshots: Snapshots) -> None:
        """`snapshots()`: by backend URL, each subscriber's `snapshot`."""
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        snapshots = self._snapshots()
        for name, help_text, family, key, spread in SERIES:
            labels = ["backend"] if spread is None else ["backend", spread[0]]
            metric = family(name, help_text, labels=labels)
            for url, snapshot in snapshots.items():
                value = snapshot[key]
                if spread is None:
                    if isinstance(value, int | float):
                        metric.add_metric([url], value)
                    continue
                assert isinstance(value, Mapping)
                for label in spread[1]:
                    metric.add_metric([url, label], value.get(label, 0))
            yield metric
        source = GaugeMetricFamily(
            "sluice_kv_events_source", SOURCE_HELP, labels=["backend", "source"]
        )
        for url, snapshot in snapshots.items():
            for name in SOURCES:
                source.add_metric([url, name], 1.0 if snapshot["source"] == name else 0.0)
        yield source
