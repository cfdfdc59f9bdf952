"""What the pool says of each backend (`BackendPool.snapshot`): a row of the dashboard's
`backends` list and of `GET /api/backends`, the fleet's own fields only (the dashboard adds
its traffic and what the router and the KV events judge of it)."""

from __future__ import annotations

from typing import TypedDict

from app.fleet.engine_metrics import EngineBlock
from app.fleet.room import RoomSnapshot


class BackendRow(TypedDict):
    id: str
    url: str
    role: str  # both, prefill or decode
    bootstrap_port: int | None  # an SGLang prefill engine's bootstrap server
    healthy: bool
    takes_traffic: bool
    breaker: str  # the most open of its breakers: closed, half-open, open
    breakers: dict[str, str]  # by model it serves
    inflight: int  # ours, sent and not ended
    unstarted: int  # of those, without a first byte yet
    pending_tokens: int  # uncached prompt tokens of ours in flight
    load: float
    reported_waiting: int
    others_inflight: int  # what its engine ran or queued beyond ours, at its last report
    others_per_own: float
    reported_kv_usage: float | None
    room: RoomSnapshot
    engine: EngineBlock | None  # None: no engine metrics recognised
    consecutive_failures: int
    probe_path: str
    models: list[str | None]  # the ids its /v1/models lists
    serves: list[str]  # the models whose pools it is in
    configured: bool  # named by a configuration, not discovered
    max_model_len: int | None
    last_error: str | None
    tokenizer: str  # not required, unchecked, checking, verified, refused
    tokenizer_detail: str | None
