"""Each model's row in the dashboard's snapshot: its pool's health and load, its requests
and hit rates. Pure: the caller passes the pool's backend rows, the directory and the
counters.

A pool's health and load come from its backends' rows (`BackendPool.snapshot`): how many
take its traffic, its breakers, requests in flight, and what their engines report about
themselves (running, waiting, KV-cache use and prefix-cache hit rate, averaged over the
backends that report one). Requests, errors and the tokenizer caches' hits are counted by
the `model` label of the metrics; time to first token over the request log's last records.
A backend that serves two models counts in both pools.

A model whose pool has prefill or decode engines (disaggregated serving) also gets a
`disaggregation` block: the same summary for each role's engines, and its requests by how
they were served (`sluice_pd_requests_total`: two hops, or one and why). Other models' rows
have no such key, so a fleet without roles reads as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import fmean
from typing import Literal, NotRequired, TypedDict

from app.fleet.backend_row import PoolMember
from app.models import ModelDirectory
from app.observe.backend_stats import is_error_code, quantile
from app.observe.request_log import RequestRecord
from app.observe.request_trace import RequestRates
from app.preprocess.model_preps import ModelDescription
from app.routing.disaggregation import TWO_HOPS

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


# The roles a disaggregated pool's summary is split by, in the order the page shows them.
ROLES = ("prefill", "decode", "both")


class ModelDisaggregation(TypedDict):
    """A model served by prefill and decode engines: each role's pool, and how its requests
    were served."""

    pools: dict[str, ModelPool]  # by role: prefill, decode, and both when it has any
    two_hops: int  # requests served disaggregated: a prefill leg, then a KV transfer
    one_hop: dict[str, int]  # requests one engine served whole, by reason
    # The proxy's leg failures by leg (prefill, decode): every disaggregated model's, as the
    # counter has no model label.
    leg_failures: dict[str, int]
    prefill_p50_ms: float | None  # prefill legs over the request log's last records
    prefill_p99_ms: float | None


class ModelRow(ModelDescription):
    """A served model in the dashboard's `models` list."""

    name: str
    aliases: list[str]
    configured: bool
    max_model_len: int | None  # its window
    pool: ModelPool
    requests: ModelRequests
    caches: ModelCaches
    disaggregation: NotRequired[ModelDisaggregation]  # only with prefill or decode engines


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return fmean(known) if known else None


def _sum(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def pool_summary(model: str, backends: Sequence[PoolMember]) -> ModelPool:
    """Health and load of one model's pool, from its backends' snapshot rows."""
    members = [b for b in backends if model in b["serves"] and b["draining_for"] is None]
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


def disaggregation_summary(
    model: str,
    backends: Sequence[PoolMember],
    served: Mapping[str, float],
    leg_failures: Mapping[str, float],
    recent: Sequence[RequestRecord],
) -> ModelDisaggregation | None:
    """`model`'s pool split by role, None when it has no prefill or decode engine. `served`:
    its requests by reason (`TWO_HOPS` for two hops); `leg_failures`: by leg."""
    members = [b for b in backends if model in b["serves"] and b["draining_for"] is None]
    if all(b["role"] == "both" for b in members):
        return None
    pools = {
        role: pool_summary(model, [b for b in members if b["role"] == role])
        for role in ROLES
        if role != "both" or any(b["role"] == role for b in members)
    }
    prefills = sorted(
        legs["prefill_ms"]
        for r in recent
        if r["model"] == model and (legs := r.get("legs")) and legs["prefill_ms"] is not None
    )
    return {
        "pools": pools,
        "two_hops": int(served.get(TWO_HOPS, 0)),
        "one_hop": {reason: int(n) for reason, n in served.items() if reason != TWO_HOPS},
        "leg_failures": {leg: int(n) for leg, n in leg_failures.items()},
        "prefill_p50_ms": quantile(prefills, 0.5),
        "prefill_p99_ms": quantile(prefills, 0.99),
    }


def model_rows(
    directory: ModelDirectory,
    backends: Sequence[PoolMember],
    described: Mapping[str, ModelDescription],
    default: ModelDescription,
    requests: Mapping[str, Mapping[str, float]],
    caches: Mapping[str, Mapping[str, float]],
    recent: Sequence[RequestRecord],
    pd_served: Mapping[str, Mapping[str, float]],
    leg_failures: Mapping[str, float],
) -> list[ModelRow]:
    """One row per served model. `described`: tokenizer and template of configured models
    (`default` for the rest); `requests`: {model: {code: n}}; `caches`: {counter (l0_hits,
    l0_misses, l1_hits, l1_misses): {model: n}}; `recent`: the request log; `pd_served`:
    {model: {reason: n}} of disaggregated models' requests; `leg_failures`: {leg: n}."""
    aliases: dict[str, list[str]] = {}
    for alias, target in sorted(directory.aliases.items()):
        aliases.setdefault(target, []).append(alias)
    rows: list[ModelRow] = []
    for name in sorted(directory.served):
        by_code = {code: int(n) for code, n in requests.get(name, {}).items()}
        ttft = sorted(r["ttft_ms"] for r in recent if r["model"] == name and r["ttft_ms"])
        hits = {counter: int(caches.get(counter, {}).get(name, 0)) for counter in CACHE_COUNTERS}
        description = described.get(name, default)
        row: ModelRow = {
            "name": name,
            "aliases": aliases.get(name, []),
            "configured": name in described,
            "tokenizer": description["tokenizer"],
            "chat_template": description["chat_template"],
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
        served = pd_served.get(name, {})
        split = disaggregation_summary(name, backends, served, leg_failures, recent)
        if split is not None:
            row["disaggregation"] = split
        rows.append(row)
    return rows
