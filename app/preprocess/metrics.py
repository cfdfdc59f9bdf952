"""Preprocessing's metrics, and the reception's counts of requests and prompt tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from app.observe.metrics import TOKENIZE_BUCKETS, Counter, Gauge, Histogram


class TokenCacheMetrics:
    """L0's and L1's hits, misses and sizes, by model."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.l0_hits = Counter(
            "sluice_tokenizer_cache_l0_hits",
            "L0 exact-match cache hits",
            ["model"],
            registry=registry,
        )
        self.l0_misses = Counter(
            "sluice_tokenizer_cache_l0_misses",
            "L0 exact-match cache misses",
            ["model"],
            registry=registry,
        )
        self.l0_entries = Gauge(
            "sluice_tokenizer_cache_l0_entries", "Entries in the L0 cache", registry=registry
        )
        self.l0_memory_bytes = Gauge(
            "sluice_tokenizer_cache_l0_memory_bytes",
            "Bytes held by the L0 cache",
            registry=registry,
        )
        self.l1_hits = Counter(
            "sluice_tokenizer_cache_l1_hits", "L1 prefix cache hits", ["model"], registry=registry
        )
        self.l1_misses = Counter(
            "sluice_tokenizer_cache_l1_misses",
            "L1 prefix cache misses",
            ["model"],
            registry=registry,
        )
        self.l1_memory_bytes = Gauge(
            "sluice_tokenizer_cache_l1_memory_bytes",
            "Bytes held by the L1 cache",
            registry=registry,
        )
        self.l1_mismatches = Counter(
            "sluice_tokenizer_cache_l1_mismatches",
            "L1 results that differed from a full encode and were discarded",
            ["model"],
            registry=registry,
        )
        self.l0_hit_tokens = Counter(
            "sluice_tokenizer_cache_l0_hit_tokens",
            "Prompt tokens served by L0 hits",
            ["model"],
            registry=registry,
        )
        self.l1_hit_tokens = Counter(
            "sluice_tokenizer_cache_l1_hit_tokens",
            "Prompt tokens served from L1's cached prefixes",
            ["model"],
            registry=registry,
        )


class PreprocessMetrics(TokenCacheMetrics):
    """Rendering and tokenizing (the caches' among them), and what the reception counts:
    requests answered and prompt tokens."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.tokenize_seconds = Histogram(
            "sluice_tokenize_seconds",
            "Time to obtain a prompt's token ids, by the path that produced them and model",
            ["path", "model"],
            buckets=TOKENIZE_BUCKETS,
            registry=registry,
        )
        self.template_seconds = Histogram(
            "sluice_template_seconds",
            "Time to render a chat template, by model",
            ["model"],
            buckets=TOKENIZE_BUCKETS,
            registry=registry,
        )
        self.tokenize_saturated = Counter(
            "sluice_tokenize_saturated",
            "Requests that found threads and the fallback permit busy",
            ["outcome"],
            registry=registry,
        )
        self.tokenize_queue_depth = Gauge(
            "sluice_tokenize_queue_depth",
            "Requests waiting for a tokenizer thread",
            registry=registry,
        )
        self.render_queue_depth = Gauge(
            "sluice_render_queue_depth",
            "Requests waiting for a render worker process",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens",
            "Prompt tokens counted, by API key (its fingerprint) and model",
            ["api_key", "model"],
            registry=registry,
        )
        self.requests = Counter(
            "sluice_requests",
            "Requests answered, by model, status code and endpoint (chat, responses, ...)",
            ["model", "code", "endpoint"],
            registry=registry,
        )
