"""Whether a backend's engine can start one more request now, as its own metrics tell. Pure:
the caller passes the backend, whose last engine report the load scraper keeps.

Design rules:
1. The engine is the judge. A request is held at the proxy only when the engine would queue
   it anyway: it reported a queue (`waiting` > 0: vLLM, SGLang and TGI's queue, llama.cpp's
   deferred requests, no idle slot), or its KV cache nearly full (`max_kv_usage`), and
   nothing of ours has finished there since. An engine that reports no load is never judged
   saturated, and takes what the policy sends it (its own queue does the rest).
2. Between two reports (every 0.5 s while traffic flows), what the proxy sent and what came
   back moves the engine's figures: `Backend.on_engine` is its last report corrected by our
   own requests in flight since (and others', in the fleet's proportion). Once an engine has
   been seen queueing, its room is known (`Backend.capacity`: what it ran then), and it is
   saturated while the requests on it reach that room, so the proxy fills it to the brim and
   no further.
3. `--max-inflight-per-backend`, when given, is a ceiling on top: our own requests on it.
"""

from __future__ import annotations

from typing import Literal

from app.fleet.backends import Backend

Saturation = Literal["ceiling", "kv", "full"]


def saturation(backend: Backend, ceiling: int | None, max_kv_usage: float) -> Saturation | None:
    """Why `backend` should start no more of our requests now, or None when it may."""
    if ceiling is not None and backend.inflight >= ceiling:
        return "ceiling"
    engine = backend.engine
    if engine is None:
        return None
    usage = engine.kv_cache_usage
    freed = backend.inflight < backend.inflight_at_report  # ours finished since its report
    if usage is not None and usage >= max_kv_usage and not freed:
        return "kv"
    capacity = backend.capacity
    if capacity is not None and backend.on_engine >= capacity:
        return "full"
    return None
