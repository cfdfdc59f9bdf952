"""What the exporters that leave the loop did: spans (`--otlp-endpoint`) and access-log lines
(`--access-log json`), read from their own counts when /metrics is scraped, so the request
path pays nothing for them. Every outcome is written from the start (zeros included)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, Metric

from app.observe.metrics import ReadAtScrape

Counts = Callable[[], Mapping[str, int]]


class ExportCollector(ReadAtScrape):
    def __init__(self, spans: Counts | None, access_log: Counts | None) -> None:
        self._spans = spans
        self._access_log = access_log

    def collect(self) -> Iterator[Metric]:
        if self._spans is not None:
            yield _family(
                "sluice_trace_spans",
                "Spans handed to the OTLP exporter, by outcome (exported; dropped: a queue "
                "was full; failed: the collector refused them or could not be reached)",
                self._spans(),
            )
        if self._access_log is not None:
            yield _family(
                "sluice_access_log_records",
                "Access-log records, by outcome (written; dropped: the queue was full; "
                "failed: not encoded or not written)",
                self._access_log(),
            )


def _family(name: str, documentation: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["outcome"])
    for outcome, count in counts.items():
        family.add_metric([outcome], float(count))
    return family
