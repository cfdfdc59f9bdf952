"""What the pool says of each backend (`BackendPool.snapshot`): a row of the dashboard's
`backends` list and of `GET /api/backends`, the fleet's own fields only (the dashboard adds
its traffic and what the router and the KV events judge of it). `PoolMember` is the part a
model's pool row sums (`BackendPool.members_summary`), cheap enough for every backend of a
fleet of a thousand, where whole rows are built for the few the page shows."""

from __future__ import annotations

from typing import TypedDict

from app.fleet.engine_metrics import EngineBlock
from app.fleet.room import RoomSnapshot


class PoolMember(TypedDict):
    id: str
    role: str  # both, prefill or decode
    healthy: bool
    breakers: dict[str, str]  # by model it serves
    inflight: int  # ours, sent and not ended
    engine: EngineBlock | None  # None: no engine metrics recognised
    serves: list[str]  # the models whose pools it is in
    draining_for: float | None  # seconds since it left the pool, while its requests finish


class BackendRow(PoolMember):
    url: str
    bootstrap_port: int | None  # an SGLang prefill engine's bootstrap server
    takes_traffic: bool
    breaker: str  # the most open of its breakers: closed, half-open, open
    unstarted: int  # of those, without a first byte yet
    pending_tokens: int  # uncached prompt tokens of ours in flight
    load: float
    reported_waiting: int
    others_inflight: int  # what its engine ran or queued beyond ours, at its last report
    others_per_own: float
    reported_kv_usage: float | None
    room: RoomSnapshot
    consecutive_failures: int
    probe_path: str
    models: list[str | None]  # the ids its /v1/models lists
    configured: bool  # named by a configuration, not discovered
    max_model_len: int | None
    last_error: str | None
    tokenizer: str  # not required, unchecked, checking, verified, refused
    tokenizer_detail: str | None
    source: str  # static, api, or the discovery source that found it (dns:..., k8s:...)
    joined_ago: float | None  # seconds since it joined the pool (None: there from start)
