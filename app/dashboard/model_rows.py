"""Each model's row in the dashboard's snapshot: its pool's health and load, its requests
and hit rates. Pure: the caller passes the pool's backend rows, the directory and the
counters.

A pool's health and load come from its backends' rows (`BackendPool.snapshot`): how many
take its traffic, its breakers, requests in flight, and what their engines report about
themselves (running, waiting, KV-cache use and prefix-cache hit rate, averaged over the
backends that report one). Requests, errors and the tokenizer caches' hits are counted by
the `model` label of the metrics; time to first token over the request log's last records.
A backend that serves two models counts in both pools.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import fmean
from typing import Literal, NotRequired, TypedDict

from app.fleet.backend_row import BackendRow
from app.models import ModelDirectory
from app.observe.backend_stats import is_error_code, quantile
from app.observe.request_log import RequestRecord
from app.observe.request_trace import RequestRates
from app.preprocess.model_preps import ModelDescription

CacheCounter = Literal["l0_hits", "l0_misses", "l1_hits", "l1_misses"]
CACHE_COUNTERS: tuple[CacheCounter, ...] = ("l0_hits", "l0_misses", "l1_hits", "l1_misses")


class ModelPool(TypedDict):
    backends: list[str]  # ids
    healthy_backends: int
    serving_backends: int  # healthy, its breaker for this model not open
    breakers_open: int
    inflight: int
    engines: list[str]  # names
    engine_running: int | None  # summed over the backends that report it
    engine_waiting: int | None
    engine_kv_cache_usage: float | None  # means
    engine_prefix_cache_hit_rate: float | None


class ModelRequests(RequestRates):
    total: int
    errors: int
    codes: dict[str, int]
    ttft_p50_ms: float | None  # over the request log's last records
    ttft_p99_ms: float | None


class ModelCaches(TypedDict):
    l0_hits: int
    l0_misses: int
    l1_hits: int
    l1_misses: int
    # Added by the dashboard's feed: over its last ticks.
    l0_hit_pct: NotRequired[float | None]
    l1_hit_pct: NotRequired[float | None]


class ModelRow(ModelDescription):
    """A served model in the dashboard's `models` list."""

    name: str
    aliases: list[str]
    configured: bool
    max_model_len: int | None  # its window
    pool: ModelPool
    requests: ModelRequests
    caches: ModelCaches


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return fmean(known) if known else None


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def pool_summary(model: str, backends: Sequence[BackendRow]) -> ModelPool:
    """Health and load of one model's pool, from its backends' snapshot rows."""
    members = [b for b in backends if model in b["serves"]]
    engines = [b["engine"] for b in members if b["engine"] is not None]
    breakers = [b["breakers"].get(model, "closed") for b in members]
    return {
        "backends": [b["id"] for b in members],
        "healthy_backends": sum(1 for b in members if b["healthy"]),
        "serving_backends": sum(
            1
            for b, state in zip(members, breakers, strict=True)
            if b["healthy"] and state != "open"
        ),
        "breakers_open": breakers.count("open"),
        "inflight": sum(b["inflight"] for b in members),
        "engines": sorted({e["name"] for e in engines}),
        "engine_running": _sum([e["running"] for e in engines]),
        "engine_waiting": _sum([e["waiting"] for e in engines]),
        "engine_kv_cache_usage": _mean([e["kv_cache_usage"] for e in engines]),
        "engine_prefix_cache_hit_rate": _mean([e["prefix_cache_hit_rate"] for e in engines]),
    }


def model_rows(
    directory: ModelDirectory,
    backends: Sequence[BackendRow],
    described: Mapping[str, ModelDescription],
    default: ModelDescription,
    requests: Mapping[str, Mapping[str, float]],
    caches: Mapping[str, Mapping[str, float]],
    recent: Sequence[RequestRecord],
) -> list[ModelRow]:
    """One row per served model. `described`: tokenizer and template of configured models
    (`default` for the rest); `requests`: {model: {code: n}}; `caches`: {counter (l0_hits,
    l0_misses, l1_hits, l1_misses): {model: n}}; `recent`: the request log."""
    aliases: dict[str, list[str]] = {}
    for alias, target in sorted(directory.aliases.items()):
        aliases.setdefault(target, []).append(alias)
    rows: list[ModelRow] = []
    for name in sorted(directory.served):
        by_code = {code: int(n) for code, n in requests.get(name, {}).items()}
        ttft = sorted(r["ttft_ms"] for r in recent if r["model"] == name and r["ttft_ms"])
        hits = {counter: int(caches.get(counter, {}).get(name, 0)) for counter in CACHE_COUNTERS}
        rows.append(
            {
                "name": name,
                "aliases": aliases.get(name, []),
                "configured": name in described,
                **described.get(name, default),
                "max_model_len": directory.windows.get(name),
                "pool": pool_summary(name, backends),
                "requests": {
                    "total": sum(by_code.values()),
                    "errors": sum(n for code, n in by_code.items() if is_error_code(code)),
                    "codes": by_code,
                    "ttft_p50_ms": quantile(ttft, 0.5),
                    "ttft_p99_ms": quantile(ttft, 0.99),
                },
                "caches": {
                    "l0_hits": hits["l0_hits"],
                    "l0_misses": hits["l0_misses"],
                    "l1_hits": hits["l1_hits"],
                    "l1_misses": hits["l1_misses"],
                },
            }
        )
    return rows
