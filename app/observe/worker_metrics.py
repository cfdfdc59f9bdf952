"""Every worker's Prometheus metrics as one exposition, each series under a `worker` label.

With `--workers N` the proxy port's `/metrics` answers from whichever worker the kernel gave
the connection, so a scraper sees a different process's counters every time and rates made
of them are nonsense. The supervisor's dashboard port serves this instead: each worker's
own text, read from its private dashboard, merged family by family (one `# TYPE` per name,
as the format requires) with `worker="i"` added to every sample, and the supervisor's own
series (`sluice_worker_up`, `sluice_worker_restarts_total`). Sums across workers are then
the scraper's `sum without (worker) (...)`. One family is combined here instead, as a sum
would be wrong: `sluice_admission_saturation` is given once per model, without the label,
from every worker's parts (app/observe/saturation_signal.py, rule 3). Pure: texts in, text
out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from app.observe.metrics import ReadAtScrape
from app.observe.saturation_signal import (
    ENGINES_SATURATED,
    HELD,
    MODEL_LABEL,
    ROOM,
    SATURATION,
    combine,
    saturation_family,
)

WORKER_LABEL = "worker"


class _Families(ReadAtScrape):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_worker_metrics(
    texts: Mapping[int, str], up: Mapping[int, bool], restarts: Mapping[int, int]
) -> bytes:
    """`texts`: by worker index, that worker's /metrics text (unreadable ones left out)."""
    families: dict[str, Metric] = {}
    for worker, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            merged.samples.extend(
                Sample(
                    s.name,
                    {**s.labels, WORKER_LABEL: str(worker)},
                    s.value,
                    s.timestamp,
                    s.exemplar,
                )
                for s in family.samples
            )
    if SATURATION in families:
        families[SATURATION] = _combined_saturation(families)
    workers_up = GaugeMetricFamily(
        "sluice_worker_up", "1 while the worker process listens", labels=[WORKER_LABEL]
    )
    restarted = CounterMetricFamily(
        "sluice_worker_restarts",
        "Times the supervisor started the worker again after it died",
        labels=[WORKER_LABEL],
    )
    for worker in sorted(up):
        workers_up.add_metric([str(worker)], 1.0 if up[worker] else 0.0)
        restarted.add_metric([str(worker)], float(restarts.get(worker, 0)))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), workers_up, restarted]))
    return generate_latest(registry)


def _combined_saturation(families: Mapping[str, Metric]) -> Metric:
    def readings(name: str) -> list[tuple[str, float]]:
        family = families.get(name)
        samples = family.samples if family is not None else []
        return [(s.labels[MODEL_LABEL], s.value) for s in samples if MODEL_LABEL in s.labels]

    combined = combine(readings(ENGINES_SATURATED), readings(HELD), readings(ROOM))
    return saturation_family(sorted(combined.items()))


class WorkerInfo(ReadAtScrape):
    """`sluice_worker_info{worker, pid} 1` in a worker's registry: which process answered a
    scrape of the shared proxy port."""

    def __init__(self, worker: int) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "sluice_worker_info",
            "This worker of sluice serve --workers N, and its process id",
            labels=[WORKER_LABEL, "pid"],
        )
        info.add_metric([str(self.worker), str(os.getpid())], 1.0)
        yield info
