"""Preprocessing's metrics, and the reception's counts of requests and prompt tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from app.observe.metrics import TOKENIZE_BUCKETS, Declare


class TokenCacheMetrics:
    """L0's, then L1's: hits, misses and the prompt tokens hits served, by model; sizes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        declare = Declare(registry)
        self.l0_hits = declare.counter(
            "sluice_tokenizer_cache_l0_hits", "L0 exact-match cache hits", ["model"]
        )
        self.l0_misses = declare.counter(
            "sluice_tokenizer_cache_l0_misses", "L0 exact-match cache misses", ["model"]
        )
        self.l0_hit_tokens = declare.counter(
            "sluice_tokenizer_cache_l0_hit_tokens", "Prompt tokens served by L0 hits", ["model"]
        )
        self.l0_entries = declare.gauge(
            "sluice_tokenizer_cache_l0_entries", "Entries in the L0 cache"
        )
        self.l0_memory_bytes = declare.gauge(
            "sluice_tokenizer_cache_l0_memory_bytes", "Bytes held by the L0 cache"
        )
        self.l1_hits = declare.counter(
            "sluice_tokenizer_cache_l1_hits", "L1 prefix cache hits", ["model"]
        )
        self.l1_misses = declare.counter(
            "sluice_tokenizer_cache_l1_misses", "L1 prefix cache misses", ["model"]
        )
        self.l1_hit_tokens = declare.counter(
            "sluice_tokenizer_cache_l1_hit_tokens",
            "Prompt tokens served from L1's cached prefixes",
            ["model"],
        )
        self.l1_mismatches = declare.counter(
            "sluice_tokenizer_cache_l1_mismatches",
            "L1 results that differed from a full encode and were discarded",
            ["model"],
        )
        self.l1_memory_bytes = declare.gauge(
            "sluice_tokenizer_cache_l1_memory_bytes", "Bytes held by the L1 cache"
        )


class PreprocessMetrics(TokenCacheMetrics):
    """Rendering and tokenizing (the caches' among them), and what the reception counts:
    requests answered and prompt tokens."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        declare = Declare(registry)
        self.tokenize_seconds = declare.histogram(
            "sluice_tokenize_seconds",
            "Time to obtain a prompt's token ids, by the path that produced them and model",
            ["path", "model"],
            buckets=TOKENIZE_BUCKETS,
        )
        self.template_seconds = declare.histogram(
            "sluice_template_seconds",
            "Time to render a chat template, by model",
            ["model"],
            buckets=TOKENIZE_BUCKETS,
        )
        self.tokenize_saturated = declare.counter(
            "sluice_tokenize_saturated",
            "Requests that found threads and the fallback permit busy",
            ["outcome"],
        )
        self.tokenize_queue_depth = declare.gauge(
            "sluice_tokenize_queue_depth", "Requests waiting for a tokenizer thread"
        )
        self.render_queue_depth = declare.gauge(
            "sluice_render_queue_depth", "Requests waiting for a render worker process"
        )
        self.prompt_tokens = declare.counter(
            "sluice_prompt_tokens",
            "Prompt tokens counted, by API key (its fingerprint) and model",
            ["api_key", "model"],
        )
        self.requests = declare.counter(
            "sluice_requests",
            "Requests answered, by model, status code and endpoint (chat, responses, ...)",
            ["model", "code", "endpoint"],
        )
