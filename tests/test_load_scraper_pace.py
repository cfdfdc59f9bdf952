"""The load scraper's pace over a fleet (app/fleet/load_scraper.py), on trio's autojump
clock with a fetcher that answers after a while and records when each scrape began: a small
fleet is read all at once, a large one at most `SCRAPES_AT_ONCE` in flight and
`SCRAPES_PER_S` begun a second, every engine still read once a round."""

from __future__ import annotations

from collections import Counter

import trio
import trio.testing

from app.fleet.load_scraper import SCRAPES_AT_ONCE, SCRAPES_PER_S, LoadScraper
from app.fleet.pool import BackendPool
from app.http.fetch import Fetched
from app.http.fields import Headers

ANSWER_S = 0.02
EXPOSITION = b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"


class SlowEngines:
    """Every engine's /metrics, answered after `ANSWER_S`."""

    def __init__(self) -> None:
        self.began: list[tuple[float, str]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def get(self, base_url: str, path: str, headers: Headers | None = None) -> Fetched:
        self.began.append((trio.current_time(), base_url))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await trio.sleep(ANSWER_S)
        finally:
            self.in_flight -= 1
        return Fetched(200, EXPOSITION)


def healthy_pool(count: int) -> BackendPool:
    urls = tuple(f"http://10.0.{n // 250}.{n % 250}:8000" for n in range(count))
    pool = BackendPool(urls, failures_to_open=3, cooldown=5.0, probe_path="/health")
    for backend in pool.backends:
        pool.health_checked(backend, True)
    return pool


async def scrape_round(count: int) -> SlowEngines:
    engines = SlowEngines()
    scraper = LoadScraper(healthy_pool(count), engines, timeout=1.0)  # type: ignore[arg-type]
    await scraper.scrape_all()
    return engines


async def test_a_small_fleet_is_read_at_once(autojump_clock: trio.testing.MockClock) -> None:
    engines = await scrape_round(8)
    assert len(engines.began) == engines.most_in_flight == 8
    assert len({at for at, _ in engines.began}) == 1


async def test_a_large_fleet_is_read_at_a_bounded_pace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    count = 1_000
    engines = await scrape_round(count)
    assert Counter(url for _, url in engines.began) == Counter(
        b.url for b in healthy_pool(count).backends
    )
    assert engines.most_in_flight <= SCRAPES_AT_ONCE
    starts = sorted(at for at, _ in engines.began)
    span = starts[-1] - starts[0]
    assert span >= (count - 1) / SCRAPES_PER_S * 0.99
    # No second holds more than its share of starts.
    per_second = Counter(int((at - starts[0]) // 1.0) for at in starts)
    assert max(per_second.values()) <= SCRAPES_PER_S + 1
