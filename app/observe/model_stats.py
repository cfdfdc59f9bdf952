"""Each model's pool as the dashboard shows it: health, load and hit rates. Pure: the caller
passes the snapshot's backends, the directory and the counters.

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
from typing import Any

from app.models import ModelDirectory
from app.observe.backend_stats import is_error_code, quantile


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return fmean(known) if known else None


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def pool_summary(model: str, backends: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Health and load of one model's pool, from its backends' snapshot rows."""
    members = [b for b in backends if model in b["serves"]]
    engines = [b["engine"] for b in members if b.get("engine")]
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
    backends: Sequence[Mapping[str, Any]],
    described: Mapping[str, Mapping[str, Any]],
    default: Mapping[str, Any],
    requests: Mapping[str, Mapping[str, float]],
    caches: Mapping[str, Mapping[str, float]],
    recent: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """One row per served model. `described`: tokenizer and template of configured models
    (`default` for the rest); `requests`: {model: {code: n}}; `caches`: {counter (l0_hits,
    l0_misses, l1_hits, l1_misses): {model: n}}; `recent`: the request log."""
    aliases: dict[str, list[str]] = {}
    for alias, target in sorted(directory.aliases.items()):
        aliases.setdefault(target, []).append(alias)
    rows = []
    for name in sorted(directory.served):
        by_code = {code: int(n) for code, n in requests.get(name, {}).items()}
        ttft = sorted(r["ttft_ms"] for r in recent if r["model"] == name and r["ttft_ms"])
        rows.append(
            {
                "name": name,
                "aliases": aliases.get(name, []),
                "configured": name in described,
                **dict(described.get(name, default)),
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
                    counter: int(by_model.get(name, 0)) for counter, by_model in caches.items()
                },
            }
        )
    return rows
