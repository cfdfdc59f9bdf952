"""Backends' own load figures, scraped off the request path from their Prometheus `/metrics`.

Every `SCRAPE_INTERVAL` seconds while traffic flows (every `IDLE_SCRAPE_INTERVAL` when none
does) each healthy backend's `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc` are read into `Backend.reported_waiting` and
`Backend.reported_kv_usage`; the policies see them through `Backend.load`. They also count
what other proxy replicas send, which local in-flight counts cannot. A backend that has no
such metrics (404, or none of those names) is asked again only every `RETRY_UNSUPPORTED`
seconds. The parse looks for two names in the text instead of parsing the whole exposition
(vLLM's is ~100 KB of histograms), so it costs the loop little.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import trio

from app.routing.backends import Backend, BackendPool

log = logging.getLogger("sluice.load_scraper")

SCRAPE_INTERVAL = 1.0
# With no request sent since the last scrape, load figures serve no decision: scrape rarely
# (a scrape of vLLM's ~100 KB exposition costs a few ms of the loop's CPU, per backend).
IDLE_SCRAPE_INTERVAL = 10.0
RETRY_UNSUPPORTED = 60.0
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of `name` (one per model) in a Prometheus text exposition."""
    total: float | None = None
    start = 0
    while True:
        found = text.find(name, start)
        if found < 0:
            return total
        start = found + len(name)
        line_end = text.find("\n", start)
        line = text[found : line_end if line_end >= 0 else len(text)]
        at_line_start = found == 0 or text[found - 1] == "\n"
        if not at_line_start or line[len(name) : len(name) + 1] not in ("{", " "):
            continue  # a comment, or a longer name that starts with this one
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        total = (total or 0.0) + value


class LoadScraper:
    def __init__(
        self,
        pool: BackendPool,
        client: httpx.AsyncClient,
        timeout: float,
        traffic: Callable[[], int],
    ) -> None:
        """`traffic` counts the requests sent to backends so far (it only ever grows)."""
        self.pool = pool
        self.client = client
        self.timeout = timeout
        self._traffic = traffic
        self._unsupported_until: dict[str, float] = {}

    async def run(self) -> None:
        seen = -1
        while True:
            await self.scrape_all()
            busy = self._traffic() != seen or any(b.inflight for b in self.pool.backends)
            seen = self._traffic()
            await trio.sleep(SCRAPE_INTERVAL if busy else IDLE_SCRAPE_INTERVAL)

    async def scrape_all(self) -> None:
        now = trio.current_time()
        current = {b.id for b in self.pool.backends}
        for gone in set(self._unsupported_until) - current:
            del self._unsupported_until[gone]
        async with trio.open_nursery() as nursery:
            for backend in self.pool.backends:
                if backend.healthy and self._unsupported_until.get(backend.id, 0.0) <= now:
                    nursery.start_soon(self.scrape, backend)

    async def scrape(self, backend: Backend) -> None:
        try:
            with trio.fail_after(self.timeout):
                response = await self.client.get(backend.url + "/metrics")
        except (trio.TooSlowError, httpx.HTTPError):
            return  # the health checker deals with backends that do not answer
        waiting = kv_usage = None
        if response.status_code == 200:
            text = response.text
            waiting, kv_usage = metric_sum(text, WAITING), metric_sum(text, KV_USAGE)
        if waiting is None and kv_usage is None:
            if backend.id not in self._unsupported_until:
                log.info("backend %s reports no vLLM load metrics; using local counts", backend.url)
            self._unsupported_until[backend.id] = trio.current_time() + RETRY_UNSUPPORTED
            backend.reported_waiting, backend.reported_kv_usage = 0, None
            return
        self._unsupported_until.pop(backend.id, None)
        backend.reported_waiting = int(waiting or 0)
        backend.reported_kv_usage = kv_usage
