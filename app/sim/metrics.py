"""The simulated backend's Prometheus `/metrics`, written the way the engine it imitates writes it.

`--metrics-style` picks whose names, labels, HELP texts and neighbouring metrics appear, so
that a proxy's scraper meets each engine's real exposition:

- `vllm`: vLLM V1's `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) through
  prometheus_client: `vllm:` names labelled `model_name` (the first served name) and
  `engine` (the engine index), counters with their `_created` samples, `vllm:cache_config_info`,
  and the Python GC, platform and process metrics of the default registry before them.
- `sglang`: SGLang's `SchedulerMetricsCollector` and `TokenizerMetricsCollector`
  (python/sglang/srt/metrics/collector.py) as its multiprocess registry serves them: scheduler
  gauges labelled `model_name`, `engine_type`, `tp_rank`, `pp_rank`; token counters labelled
  `model_name`; no `_created` samples and no process metrics.
- `llamacpp`: the llama.cpp server's `/metrics` handler (tools/server), which writes the text
  itself: `# HELP`, `# TYPE` and one unlabelled sample per metric, counters first. This is the
  server as it was before ggml-org/llama.cpp#13660 (May 2025) dropped `kv_cache_usage_ratio`
  and `kv_cache_tokens`; newer builds report no KV use at all.
- `tgi`: text-generation-inference's router through metrics-exporter-prometheus 0.15:
  unlabelled gauges, counters without a `_total` suffix, and a blank line after each family.

Beside each style's own, every style exposes the simulator's disaggregation counters
(kv_transfer.py's `PdCounters`) in Prometheus' text format, labelled as no engine does:
`sluice_sim_pd_recomputed_requests_total{reason}`, `sluice_sim_pd_recomputed_tokens_total{reason}`
and `sluice_sim_pd_transfers_total{role}`, plus their sums over the label under DESIGN.md's
names (`sim:pd_recomputed_prompts_total`, `sim:pd_transfers_total`): one number a test reads.
With LoRA on (lora.py), vLLM's `vllm:lora_requests_info` (vllm style) and, in every style, the
sim's `sim:lora_loads_total`, `sim:lora_reloads_total` and `sim:lora_requests_total{adapter}`.

The engine keeps every number; each style reads them at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from app.sim.engine import SimEngine
from app.sim.kv_transfer import PdCounters
from app.sim.lora import LoraRegistry
from app.sim.observed import Observed
from app.sim.settings import SimSettings

# vLLM's own HELP texts.
RUNNING_HELP = "Number of requests in model execution batches."
WAITING_HELP = "Number of requests waiting to be processed."
KV_USAGE_HELP = "KV-cache usage. 1 means 100 percent usage."
QUERIES_HELP = "Prefix cache queries, in terms of number of queried tokens."
HITS_HELP = "Prefix cache hits, in terms of number of cached tokens."
PREEMPTIONS_HELP = "Cumulative number of preemption from the engine."
PROMPT_HELP = "Number of prefill tokens processed."
GENERATION_HELP = "Number of generation tokens processed."
QUEUE_HELP = "Histogram of time spent in WAITING phase for request."
GAP_HELP = "Histogram of inter-token latency in seconds."


class _VllmCollector:
    def __init__(self, engine: SimEngine, settings: SimSettings, created: float) -> None:
        self._engine = engine
        self._settings = settings
        self._labels = {"model_name": settings.served_models[0], "engine": "0"}
        self._created = created

    def collect(self) -> Iterator[Metric]:
        engine, kv_cache = self._engine, self._engine.kv_cache
        # The simulated scheduler never preempts: a sequence holds its blocks to the end.
        series = (
            ("gauge", "vllm:num_requests_running", RUNNING_HELP, engine.running),
            ("gauge", "vllm:num_requests_waiting", WAITING_HELP, engine.waiting),
            ("gauge", "vllm:kv_cache_usage_perc", KV_USAGE_HELP, kv_cache.usage),
            ("counter", "vllm:prefix_cache_queries", QUERIES_HELP, kv_cache.query_tokens),
            ("counter", "vllm:prefix_cache_hits", HITS_HELP, kv_cache.hit_tokens),
            ("counter", "vllm:num_preemptions", PREEMPTIONS_HELP, 0),
            ("counter", "vllm:prompt_tokens", PROMPT_HELP, engine.prompt_tokens_total),
            ("counter", "vllm:generation_tokens", GENERATION_HELP, engine.generation_tokens_total),
        )
        for kind, name, help_text, value in series:
            yield (self._gauge if kind == "gauge" else self._counter)(name, help_text, value)
        yield self._histogram("vllm:request_queue_time_seconds", QUEUE_HELP, engine.queue_times)
        yield self._histogram("vllm:inter_token_latency_seconds", GAP_HELP, engine.token_gaps)
        config = {
            "block_size": str(self._settings.block_size),
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(self._settings.kv_cache_blocks),
            "engine": "0",
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(config),
        )
        info.add_metric(list(config.values()), 1)
        yield info
        lora = self._engine.lora
        if lora is not None:
            # vLLM's labels, in its order; one series per label set a step ever set (lora.py).
            labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
            lora_info = GaugeMetricFamily(
                "vllm:lora_requests_info", "Running stats on lora requests.", labels=labels
            )
            for running, waiting, when in lora.info_series():
                lora_info.add_metric([str(lora.max_loras), waiting, running], when)
            yield lora_info

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def _histogram(self, name: str, documentation: str, seen: Observed) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), seen.buckets(), seen.total)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value, created=self._created)
        return family


class _SglangCollector:
    def __init__(self, engine: SimEngine, settings: SimSettings) -> None:
        self._engine = engine
        model = settings.served_models[0]
        self._scheduler_labels = {
            "model_name": model,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
        }
        self._tokenizer_labels = {"model_name": model}

    def collect(self) -> Iterator[Metric]:
        engine, kv_cache = self._engine, self._engine.kv_cache
        scheduler = self._scheduler_labels
        yield _gauge(
            "sglang:num_running_reqs", "The number of running requests.", scheduler, engine.running
        )
        yield _gauge(
            "sglang:num_used_tokens",
            "The number of used tokens.",
            scheduler,
            kv_cache.used_blocks * kv_cache.block_size,
        )
        yield _gauge("sglang:token_usage", "The token usage.", scheduler, kv_cache.usage)
        yield _gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            scheduler,
            engine.waiting,
        )
        yield _gauge(
            "sglang:cache_hit_rate",
            "The prefix cache hit rate.",
            scheduler,
            engine.last_prefill_hit_rate,
        )
        yield _gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            scheduler,
            kv_cache.num_blocks * kv_cache.block_size,
        )
        tokenizer = self._tokenizer_labels
        yield _counter(
            "sglang:prompt_tokens",
            "Number of prefill tokens processed.",
            tokenizer,
            engine.prompt_tokens_total,
        )
        yield _counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            tokenizer,
            engine.generation_tokens_total,
        )
        yield _counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens.",
            tokenizer,
            kv_cache.hit_tokens,
        )


def _gauge(name: str, documentation: str, labels: dict[str, str], value: float) -> Metric:
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, documentation: str, labels: dict[str, str], value: float) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def llamacpp_exposition(engine: SimEngine) -> bytes:
    kv_cache = engine.kv_cache
    processed = engine.prompt_tokens_total - kv_cache.hit_tokens  # cached tokens cost nothing
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed.", processed),
        ("prompt_seconds_total", "Prompt process time", engine.prefill_seconds_total),
        (
            "tokens_predicted_total",
            "Number of generation tokens processed.",
            engine.generation_tokens_total,
        ),
        ("tokens_predicted_seconds_total", "Predict process time", engine.decode_seconds_total),
        ("n_decode_total", "Total number of llama_decode() calls", engine.steps),
        (
            "n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            engine.batched_seqs_total / max(engine.steps, 1),
        ),
    ]
    gauges = [
        (
            "prompt_tokens_seconds",
            "Average prompt throughput in tokens/s.",
            _per_second(processed, engine.prefill_seconds_total),
        ),
        (
            "predicted_tokens_seconds",
            "Average generation throughput in tokens/s.",
            _per_second(engine.generation_tokens_total, engine.decode_seconds_total),
        ),
        ("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", kv_cache.usage),
        ("kv_cache_tokens", "KV-cache tokens.", kv_cache.used_blocks * kv_cache.block_size),
        ("requests_processing", "Number of request processing.", engine.running),
        ("requests_deferred", "Number of request deferred.", engine.waiting),
    ]
    lines: list[str] = []
    for kind, metrics in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in metrics:
            # C++'s `stream << double`: six significant digits, as printf's %g.
            lines += [
                f"# HELP llamacpp:{name} {help_text}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {value:g}",
            ]
    return ("\n".join(lines) + "\n").encode()


def _per_second(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def tgi_exposition(engine: SimEngine) -> bytes:
    calls = {"decode": engine.decode_steps, "prefill": engine.prefill_steps}
    families = [
        (
            "tgi_batch_inference_count",
            "counter",
            "Inference calls per method (prefill or decode)",
            calls,
        ),
        (
            "tgi_batch_inference_success",
            "counter",
            "Number of successful inference calls per method (prefill or decode)",
            calls,
        ),
        ("tgi_batch_current_size", "gauge", "Current batch size", {"": engine.running}),
        ("tgi_queue_size", "gauge", "Current queue size", {"": engine.waiting}),
    ]
    out: list[str] = []
    for name, kind, help_text, samples in families:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for method, value in samples.items():
            labels = f'{{method="{method}"}}' if method else ""
            out.append(f"{name}{labels} {_rust_number(value)}")
        out.append("")  # metrics-exporter-prometheus ends every family with a blank line
    return ("\n".join(out) + "\n").encode()


def _rust_number(value: float) -> str:
    """As Rust's `Display` prints an f64: no `.0` on whole numbers."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _PdCollector:
    def __init__(self, counters: PdCounters) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        counters = self._counters
        series = (
            (
                "sluice_sim_pd_recomputed_requests",
                "Requests a decode engine prefilled itself, by why no KV was transferred.",
                "reason",
                counters.recomputed_requests,
            ),
            (
                "sluice_sim_pd_recomputed_tokens",
                "Prompt tokens a decode engine prefilled itself, by why.",
                "reason",
                counters.recomputed_tokens,
            ),
            (
                "sluice_sim_pd_transfers",
                "KV transfers: handed out (prefill) or taken (decode).",
                "role",
                counters.transfers,
            ),
        )
        for name, help_text, label, values in series:
            family = CounterMetricFamily(name, help_text, labels=[label])
            for value_label, value in values.items():
                family.add_metric([value_label], value)
            yield family
        yield CounterMetricFamily(
            "sim:pd_recomputed_prompts",
            "sluice_sim_pd_recomputed_requests_total, every reason.",
            value=sum(counters.recomputed_requests.values()),
        )
        yield CounterMetricFamily(
            "sim:pd_transfers",
            "sluice_sim_pd_transfers_total, both roles.",
            value=sum(counters.transfers.values()),
        )


class _LoraCollector:
    def __init__(self, registry: LoraRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        registry = self._registry
        yield CounterMetricFamily(
            "sim:lora_loads",
            "LoRA adapters loaded: --lora-modules and the load endpoints.",
            value=registry.loads_total,
        )
        yield CounterMetricFamily(
            "sim:lora_reloads",
            "Adapters evicted from memory that a step loaded again.",
            value=registry.reloads_total,
        )
        requests = CounterMetricFamily(
            "sim:lora_requests", "Requests the engine ran, by adapter.", labels=["adapter"]
        )
        for name, count in registry.requests_by_adapter.items():
            requests.add_metric([name], count)
        yield requests


class SimMetrics:
    """One exposition per simulated server, so several in one process never mix numbers."""

    def __init__(
        self, engine: SimEngine, settings: SimSettings, pd: PdCounters | None = None
    ) -> None:
        self._exposition: Callable[[], bytes]
        style = settings.metrics_style
        pd_registry = CollectorRegistry(auto_describe=False)
        pd_registry.register(_PdCollector(pd or PdCounters()))
        if engine.lora is not None:
            pd_registry.register(_LoraCollector(engine.lora))
        if style == "llamacpp":
            self._exposition = lambda: llamacpp_exposition(engine) + generate_latest(pd_registry)
        elif style == "tgi":
            self._exposition = lambda: tgi_exposition(engine) + generate_latest(pd_registry)
        else:
            registry = CollectorRegistry(auto_describe=False)
            if style == "vllm":
                # vLLM serves prometheus_client's default registry, where these come first.
                GCCollector(registry=registry)
                PlatformCollector(registry=registry)
                ProcessCollector(registry=registry)
                registry.register(_VllmCollector(engine, settings, time.time()))
            else:
                registry.register(_SglangCollector(engine, settings))
            self._exposition = lambda: generate_latest(registry) + generate_latest(pd_registry)

    def exposition(self) -> bytes:
        return self._exposition()
