"""Small whole-body exchanges, for the fleet's watchers (health checks, model lists, load
scrapes, tokenizer checks), the supervisor's reads of its workers' dashboards and the demo's
simulated clients: a GET, or a JSON POST or PUT, the answer read whole, on keep-alive
connections of a pool of their own, so that they never take forwarding's slots.

Why not httpx (which these callers used): measured on these machines against a simulated
backend's /metrics (5 KB), httpx cost the loop 1.1 ms of CPU a request on a warm connection and
2.2-2.8 ms on a fresh one (an idle proxy's scrapes and probes come seconds apart, past its
pool's keep-alive); this client 0.15 and 0.3-0.45 ms. The watchers were over half an idle
proxy's CPU, and a scrape of every backend every 0.5 s is a steady cost while traffic flows.
Callers bound the time; an answer's status is theirs to judge (`Fetched.ok`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import trio

from app.http.client import UpstreamPool
from app.http.fields import Headers

# A watcher's answer is a health word, a model list or a metrics exposition (vLLM's: ~100
# KB); a backend that sends more is not read further.
MAX_ANSWER_BYTES = 8 << 20
JSON_HEADERS = [(b"content-type", b"application/json"), (b"accept", b"application/json")]


@dataclass(frozen=True)
class Fetched:
    status: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON; `ValueError` if it is not."""
        return json.loads(self.body)

    @property
    def ok(self) -> bool:
        return self.status < 400

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class Fetcher:
    """`get`, `post_json` and `put_json`; `UpstreamError` when the server cannot be reached or
    answers out of HTTP, or its answer is over `max_answer_bytes`."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        max_idle_per_backend: int = 2,
    ) -> None:
        # A watcher asks a few things of a backend at once at most (probe, models, scrape,
        # tokenizer check); the demo's clients keep more connections busy.
        self._pool = UpstreamPool(
            connect_timeout=connect_timeout,
            max_connections=256,
            max_idle_per_backend=max_idle_per_backend,
        )
        self.max_answer_bytes = max_answer_bytes

    async def get(self, base_url: str, path: str, headers: Headers | None = None) -> Fetched:
        return await self.exchange(base_url, path, b"GET", b"", headers)

    async def post_json(
        self, base_url: str, path: str, payload: Any, headers: Headers | None = None
    ) -> Fetched:
        return await self.exchange(base_url, path, b"POST", json.dumps(payload).encode(), headers)

    async def put_json(
        self, base_url: str, path: str, payload: Any, headers: Headers | None = None
    ) -> Fetched:
        return await self.exchange(base_url, path, b"PUT", json.dumps(payload).encode(), headers)

    async def exchange(
        self,
        base_url: str,
        path: str,
        method: bytes,
        body: bytes,
        headers: Headers | None = None,
    ) -> Fetched:
        sent = [*(JSON_HEADERS if body else ()), *(headers or ())]
        response = await self._pool.request(base_url, path, sent, body, method)
        whole = False
        try:
            answer = await response.read_rest(math.inf, self.max_answer_bytes)
            whole = True
        finally:
            # Closed if cut short or over the bound, whatever state it was left in.
            with trio.CancelScope(shield=True):
                await response.release(reusable=whole)
        return Fetched(response.status_code, answer)

    async def aclose(self) -> None:
        await self._pool.aclose()
