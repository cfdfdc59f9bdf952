"""Backends' own load figures, scraped off the request path from their Prometheus `/metrics`.

Every `SCRAPE_INTERVAL` seconds while traffic flows (every `IDLE_SCRAPE_INTERVAL` when none
does, and at once when it starts again) each healthy backend's
exposition is read by `engine_metrics.read_engine`, which knows vLLM, SGLang, the llama.cpp
server and TGI by their metric names. The result goes to `Backend.engine` (engine name,
running, waiting, KV use, prefix hit rate) through `Backend.engine_reported`, and after
each round the fleet's ratio of others' requests to ours (`BackendPool.engines_reported`).
The policies see both in `Backend.load`: it also counts what other proxy replicas send,
which local in-flight counts cannot. A backend that has no such metrics (404, or none of
those names) is asked again only every `RETRY_UNSUPPORTED` seconds. Each report is read
against what was true when it was asked for (`Backend.asking`): when, how many of our
requests were on the backend (what it ran beyond those is others'), whether one of ours
waited unstarted since the report before. An engine that states its limit (engine_limits.py)
is asked for it after its first report and after each restart; one that says nothing is
asked again every `RETRY_UNSUPPORTED` seconds. vLLM's `vllm:lora_requests_info` in the same
text says which LoRA adapters its engine runs (adapters.py).

A large fleet is read at a bounded pace: at most `SCRAPES_AT_ONCE` in flight (answers that
come together wake their tasks together, and the loop runs them all before anything else)
and at most `SCRAPES_PER_S` begun a second. Past `SCRAPES_PER_S * SCRAPE_INTERVAL` engines
(100) a round is spread over longer than the interval and each engine is read less often;
past `SCRAPES_PER_S * STALE_REPORT_S` (400) its report ages out between reads, and its room
is judged on our own requests alone, as for an engine without metrics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from app.errors import UpstreamError
from app.fleet.adapters import read_lora
from app.fleet.backends import Backend
from app.fleet.engine_limits import LIMIT_PATHS, stated_limit
from app.fleet.engine_metrics import EngineName, EngineReading, next_load, read_engine
from app.fleet.pool import BackendPool
from app.fleet.traffic import NO_TRAFFIC, TrafficSource
from app.http.fetch import Fetcher

log = logging.getLogger("sluice.load_scraper")

# Others' share of a GPU's work is as old as the last scrape. Measured (4 replicas, 4
# simulated GPUs, the hot workload): every second, the replicas piled a hot prefix on the GPUs
# that looked free a second ago; every 0.5 s, p50 TTFT fell by half. A scrape of vLLM's ~100 KB
# exposition cost ~1.1 ms of the loop's CPU (fetch and `read_engine`) with httpx, ~2 ms/s a
# backend; the watchers' own client (app/http/fetch.py) fetches for a seventh of httpx's cost.
SCRAPE_INTERVAL = 0.5
# With no request sent since the last scrape, load figures serve no decision: scrape rarely.
IDLE_SCRAPE_INTERVAL = 10.0
RETRY_UNSUPPORTED = 60.0
# A scrape of the simulator's 11 KB exposition costs the loop 0.39 ms (fetched and read):
# 200 a second are ~8% of it (a real vLLM's ~100 KB costs more).
SCRAPES_PER_S = 200
SCRAPES_AT_ONCE = 16


@dataclass(eq=False)
class LoadScraper:
    """`traffic` paces it (every SCRAPE_INTERVAL while requests ask for backends, at once
    when they start again, held ones too); `reported` is told after each round of reports
    (an engine may have room now)."""

    pool: BackendPool
    client: Fetcher
    timeout: float
    traffic: TrafficSource = NO_TRAFFIC
    reported: Callable[[], None] = lambda: None
    _unsupported_until: dict[str, float] = field(default_factory=dict, init=False)
    _last_reading: dict[str, EngineReading] = field(default_factory=dict, init=False)
    # Backend id -> (its room's restarts, when) its stated limit was last asked for.
    _limit_asked: dict[str, tuple[int, float]] = field(default_factory=dict, init=False)

    async def run(self) -> None:
        # Traffic that starts after a quiet spell is scraped for at once, not after the rest
        # of a long idle sleep. Measured (4 replicas, 4 simulated GPUs): sleeping 10 s after a
        # quiet spell left the replicas blind to the GPUs' queues for the first ~8 s of a
        # burst, one GPU queueing 20-29 requests while the others idled, p50 TTFT 10x one
        # replica's. A request held on a quiet spell's report counts as traffic: measured (bench
        # streams, others' 200 streams on the GPU while this proxy idled), 50 requests held on
        # that stale report waited ~2 s for the next idle scrape, 0.85x direct's tokens/s. An
        # idle proxy does not wake to look (each wake-up costs the loop ~0.4 ms).
        scraped_at = -math.inf
        while True:
            await trio.sleep_until(scraped_at + SCRAPE_INTERVAL)
            seen = self.traffic.requests
            scraped_at = trio.current_time()
            await self.scrape_all()
            if self.traffic.requests == seen and not self.traffic.busy:
                with trio.move_on_after(IDLE_SCRAPE_INTERVAL):
                    await self.traffic.next_request()

    async def scrape_all(self) -> None:
        now = trio.current_time()
        current = {b.id for b in self.pool.backends}
        for gone in set(self._unsupported_until) - current:
            del self._unsupported_until[gone]
        for gone in set(self._last_reading) - current:
            del self._last_reading[gone]
        for gone in set(self._limit_asked) - current:
            del self._limit_asked[gone]
        due = [
            backend
            for backend in self.pool.backends
            if backend.healthy and self._unsupported_until.get(backend.id, 0.0) <= now
        ]
        # A fleet read within the interval at the pace allowed is read at once.
        spacing = 0.0 if len(due) <= SCRAPES_PER_S * SCRAPE_INTERVAL else 1 / SCRAPES_PER_S
        slots = trio.CapacityLimiter(SCRAPES_AT_ONCE)
        async with trio.open_nursery() as nursery:
            for n, backend in enumerate(due):
                if spacing:
                    await trio.sleep_until(now + n * spacing)
                await slots.acquire_on_behalf_of(backend)
                nursery.start_soon(self._scrape_in, slots, backend)
        self.pool.engines_reported()
        self.reported()

    async def _scrape_in(self, slots: trio.CapacityLimiter, backend: Backend) -> None:
        try:
            await self.scrape(backend)
        finally:
            slots.release_on_behalf_of(backend)

    async def scrape(self, backend: Backend) -> None:
        asked = backend.asking(trio.current_time())
        try:
            with trio.fail_after(self.timeout):
                response = await self.client.get(backend.url, "/metrics")
        except (trio.TooSlowError, UpstreamError):
            return  # the health checker deals with backends that do not answer
        reading = read_engine(response.text) if response.status == 200 else None
        lora = read_lora(response.text) if reading is not None else None
        backend.adapters.reported(lora, asked.at)
        if reading is None:
            if backend.id not in self._unsupported_until:
                log.info(
                    "backend %s reports no engine load metrics; using local counts", backend.url
                )
            self._unsupported_until[backend.id] = trio.current_time() + RETRY_UNSUPPORTED
            self._last_reading.pop(backend.id, None)
            backend.engine_reported(None, asked)
            return
        self._unsupported_until.pop(backend.id, None)
        if backend.engine is None or backend.engine.name != reading.engine:
            log.info("backend %s: %s metrics", backend.url, reading.engine)
        earlier = self._last_reading.get(backend.id)
        self._last_reading[backend.id] = reading
        backend.engine_reported(next_load(reading, earlier, backend.engine), asked)
        await self._read_limit(backend, reading.engine)

    async def _read_limit(self, backend: Backend, engine: EngineName) -> None:
        """Ask an engine that may state its limit: after each restart, and while it states
        none, every RETRY_UNSUPPORTED."""
        path = LIMIT_PATHS.get(engine)
        room = backend.room
        if path is None:
            return
        now = trio.current_time()
        restarts, at = self._limit_asked.get(backend.id, (-1, -math.inf))
        if restarts == room.restarts and (
            room.stated_limit is not None or now - at < RETRY_UNSUPPORTED
        ):
            return
        self._limit_asked[backend.id] = (room.restarts, now)
        try:
            with trio.fail_after(self.timeout):
                response = await self.client.get(backend.url, path)
            answer = response.json() if response.status == 200 else None
        except (trio.TooSlowError, UpstreamError, ValueError):
            return
        if answer is None:
            return
        limit = stated_limit(engine, answer)
        if limit is not None and room.stated_limit != limit:
            log.info(
                "backend %s states it runs %d sequences at once (%s)", backend.url, limit, path
            )
        room.stated(limit, path)
