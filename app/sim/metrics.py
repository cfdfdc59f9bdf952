"""The simulated backend's Prometheus metrics, under vLLM's names and `model_name` label.

The engine already keeps every number; a collector reads them at scrape time instead of
mirroring each change into separate metric objects.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.sim.engine import SimEngine


class _EngineCollector:
    def __init__(self, engine: SimEngine, model: str) -> None:
        self._engine = engine
        self._model = model

    def collect(self) -> Iterator[Metric]:
        engine, kv_cache = self._engine, self._engine.kv_cache
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            engine.running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            engine.waiting,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            kv_cache.usage,
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            kv_cache.query_tokens,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            kv_cache.hit_tokens,
        )
        yield self._counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            engine.prompt_tokens_total,
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            engine.generation_tokens_total,
        )

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([self._model], value)
        return family


class SimMetrics:
    """One registry per simulated server, so several in one process never mix numbers."""

    def __init__(self, engine: SimEngine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
