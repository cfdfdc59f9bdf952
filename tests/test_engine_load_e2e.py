"""Engines' own load figures end to end: one simulated backend per metrics style (vLLM, SGLang,
llama.cpp server, TGI), the load scraper reading each over HTTP into the backend's state, the
prefix hit rate over a scrape interval, a backend without engine metrics, and the dashboard's
`/api/snapshot` carrying each backend's `engine` block; the engines that state their limit,
and a restarted engine told by its metrics. Then, pure: how a GPU's load counts
other replicas' requests, as reported and, between reports, moving as ours do in the fleet's
proportion of theirs to ours. Last, the pace of the scraper and the health checks when no
request is sent, and when one is."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, get_args

import httpx
import pytest
import trio
import trio.testing

from app.cli.rooms import RoomMetrics
from app.fleet.engine_metrics import EngineLoad
from app.fleet.health import HealthChecker
from app.fleet.load_scraper import LoadScraper
from app.fleet.pool import MAX_OTHERS_PER_OWN, BackendPool
from app.fleet.room import REFUSALS_TO_LEARN, Seen
from app.http.exchange import Exchange
from app.http.fetch import Fetcher
from app.sim.settings import MetricsStyle
from tests.conftest import FakeTraffic, StartBackend, StartSim, StartSluice, wait_until
from tests.sims import QUEUEING, QUICK, one_running_one_waiting

STYLES: tuple[MetricsStyle, ...] = get_args(MetricsStyle)
SYSTEM = {"role": "system", "content": "Answer in haiku. " * 30}


def healthy_pool(urls: list[str]) -> BackendPool:
    pool = BackendPool(tuple(urls), failures_to_open=1, cooldown=1.0, probe_path="/health")
    for backend in pool.backends:
        pool.health_checked(backend, True)
    return pool


def scraper(pool: BackendPool, client: httpx.AsyncClient) -> LoadScraper:
    """A scraper on its own lean client (`client` is the test's, for its own requests)."""
    return LoadScraper(pool, Fetcher(connect_timeout=5.0), timeout=5.0)


async def ask(client: httpx.AsyncClient, url: str, question: str) -> None:
    request = {"messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 2}
    (await client.post(url + "/v1/chat/completions", json=request)).raise_for_status()


async def test_the_scraper_reads_every_engines_queue_and_kv_use(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(QUEUEING, metrics_style=style) for style in STYLES]
    pool = healthy_pool([sim.url for sim in sims])
    async with trio.open_nursery() as nursery:
        for sim in sims:
            await one_running_one_waiting(nursery, client, sim)
        for backend in pool.backends:
            backend.inflight = 1  # one of the two is taken to be this replica's
        await scraper(pool, client).scrape_all()
        # Before the clients leave and free their blocks.
        usages = [sim.app.engine.kv_cache.usage for sim in sims]
        nursery.cancel_scope.cancel()

    for style, backend, usage in zip(STYLES, pool.backends, usages, strict=True):
        engine = backend.engine
        assert engine is not None, style
        assert (engine.name, engine.running, engine.waiting) == (style, 1, 1)
        assert backend.reported_waiting == 1
        assert (backend.others_inflight, backend.others_per_own) == (1, 1.0)
        if style == "tgi":
            assert engine.kv_cache_usage is None
        else:
            assert engine.kv_cache_usage == pytest.approx(usage, rel=1e-5)
        assert backend.reported_kv_usage == engine.kv_cache_usage


async def test_an_engine_that_states_its_limit_has_it_as_its_room(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(QUEUEING, metrics_style=style, max_num_seqs=6) for style in STYLES]
    pool = healthy_pool([sim.url for sim in sims])
    await scraper(pool, client).scrape_all()
    rooms = {
        style: (b.room.room, b.room.basis) for style, b in zip(STYLES, pool.backends, strict=True)
    }
    # SGLang's /get_server_info and llama.cpp's /props say; vLLM says nothing, nor does TGI
    # unless it was given --max-batch-size.
    assert rooms == {
        "vllm": (None, "unknown"),
        "sglang": (6, "stated"),
        "llamacpp": (6, "stated"),
        "tgi": (None, "unknown"),
    }


async def test_an_engine_restarted_on_its_address_is_known_again_by_its_metrics(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    """A new vLLM process behind the same URL: its counters' creation time changed, and the
    room learnt of the old one is kept only until the new one shows otherwise."""
    first = await start_sim(metrics_style="vllm")
    pool = healthy_pool([first.url])
    (backend,) = pool.backends
    reads = scraper(pool, client)
    await reads.scrape_all()
    for _ in range(REFUSALS_TO_LEARN):
        backend.room.reported(Seen(8, 3, True))  # as if seen refusing: a room of 8
    assert backend.room.room == 8
    first.kill()
    await start_sim(metrics_style="vllm", port=first.port)
    await reads.scrape_all()
    assert backend.engine is not None and backend.engine.restarted
    room = backend.room  # kept, until the new process shows otherwise
    assert (room.room, room.provisional, room.most) == (8, True, 0)
    assert "restarted" in room.why


async def test_vllm_hit_rate_covers_the_prompts_between_two_scrapes(
    start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(QUICK, metrics_style="vllm")
    url, app = sim.url, sim.app
    pool = healthy_pool([url])
    (backend,) = pool.backends
    scrapes = scraper(pool, client)
    await ask(client, url, "warm up")
    await scrapes.scrape_all()
    assert backend.engine is not None and backend.engine.prefix_cache_hit_rate is None

    kv_cache = app.engine.kv_cache
    queries, hits = kv_cache.query_tokens, kv_cache.hit_tokens
    await ask(client, url, "first question")
    await ask(client, url, "second question")
    await scrapes.scrape_all()
    expected = (kv_cache.hit_tokens - hits) / (kv_cache.query_tokens - queries)
    assert 0 < expected < 1
    assert backend.engine.prefix_cache_hit_rate == pytest.approx(expected)

    await scrapes.scrape_all()  # nothing asked since: the rate stands
    assert backend.engine.prefix_cache_hit_rate == pytest.approx(expected)


async def test_a_backend_without_engine_metrics_counts_no_queue(
    start_backend: StartBackend, client: httpx.AsyncClient
) -> None:
    async def no_metrics(exchange: Exchange) -> None:
        await exchange.respond(404, [(b"content-type", b"text/plain")], b"not here")

    pool = healthy_pool([await start_backend(no_metrics)])
    (backend,) = pool.backends
    backend.reported_waiting = 3
    await scraper(pool, client).scrape_all()
    assert (backend.engine, backend.reported_waiting, backend.reported_kv_usage) == (None, 0, None)


async def test_the_snapshot_carries_each_backends_engine_block(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = {style: await start_sim(metrics_style=style) for style in ("sglang", "tgi")}
    running = await start_sluice([sim.url for sim in sims.values()])
    for sim in sims.values():
        await ask(client, sim.url, "warm up")  # SGLang's hit rate is that of its last prefill

    async def engines() -> dict[str, Any]:
        response = await client.get(running.dashboard_url + "/api/snapshot")
        return {b["url"]: b["engine"] for b in response.json()["backends"]}

    async def all_scraped() -> bool:
        return all(engine is not None for engine in (await engines()).values())

    await wait_until(all_scraped)
    found = await engines()
    assert found[sims["sglang"].url] == {
        "name": "sglang",
        "running": 0,
        "waiting": 0,
        "kv_cache_usage": 0.0,
        "prefix_cache_hit_rate": 0.0,
        "restarted": False,
        "queue_wait_s": None,
        "step_s": None,
    }
    assert found[sims["tgi"].url] == {
        "name": "tgi",
        "running": 0,
        "waiting": 0,
        "kv_cache_usage": None,
        "prefix_cache_hit_rate": None,
        "restarted": False,
        "queue_wait_s": None,  # its histograms say nothing while no request finished
        "step_s": None,
    }


async def test_traffic_after_a_quiet_spell_is_scraped_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Idle, the scraper reads the engines every 10 s and wakes for nothing else; once a
    request is sent again it must not finish that sleep first (replicas routed blind to the
    GPUs' queues for seconds), and while traffic flows it reads every SCRAPE_INTERVAL."""
    traffic = FakeTraffic()
    scraped: list[float] = []
    load_scraper = LoadScraper(
        healthy_pool(["http://gpu:8000"]),
        None,  # type: ignore[arg-type]
        timeout=5.0,
        traffic=traffic,
    )
    load_scraper.scrape_all = noting_when(scraped)  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(load_scraper.run)
        await trio.sleep(25.25)
        assert scraped == [0.0, 10.0, 20.0]
        traffic.busy = True  # a request sent, its answer long (or held for room)
        traffic.send()
        await trio.sleep(1.1)
        nursery.cancel_scope.cancel()
    assert scraped[3:] == [25.25, 25.75, 26.25]  # at once, then while it runs


def noting_when(times: list[float]) -> Callable[[], Awaitable[None]]:
    """A stand-in for a round of scrapes or checks: it notes the (virtual) time it ran at."""

    async def note() -> None:
        times.append(trio.current_time())

    return note


def engine_load(running: int, waiting: int) -> EngineLoad:
    return EngineLoad("vllm", running, waiting, kv_cache_usage=0.5, prefix_cache_hit_rate=None)


def test_a_gpus_load_counts_what_other_replicas_run_on_it() -> None:
    (backend,) = healthy_pool(["http://gpu:8000"]).backends
    backend.inflight = 2  # this replica's requests
    assert backend.load == 2
    backend.engine_reported(engine_load(running=8, waiting=5))
    assert backend.others_inflight == 8 + 5 - 2
    assert backend.load == 8 + 5 + 5  # everyone's requests, the queue once more
    backend.inflight = 3  # ours count at once; others' wait for the next report
    assert backend.load == 8 + 5 + 5 + 1
    backend.engine_reported(None)
    assert (backend.others_inflight, backend.reported_waiting, backend.load) == (0, 0, 3)


def test_one_replica_alone_sees_only_its_own_requests_and_the_queue() -> None:
    (backend,) = healthy_pool(["http://gpu:8000"]).backends
    backend.inflight = 6
    backend.engine_reported(engine_load(running=4, waiting=2))  # all six ours
    assert (backend.others_inflight, backend.load) == (0, 6 + 2)
    backend.engine_reported(engine_load(running=3, waiting=0))  # ours, still on their way
    assert (backend.others_inflight, backend.load) == (0, 6)


def test_between_reports_others_move_as_ours_do_in_the_fleets_proportion() -> None:
    pool = healthy_pool(["http://gpu-a:8000", "http://gpu-b:8000"])
    a, b = pool.backends
    a.inflight, b.inflight = 2, 1
    a.engine_reported(engine_load(running=8, waiting=0))  # 6 of others beside our 2
    b.engine_reported(engine_load(running=4, waiting=0))  # 3 beside our 1
    pool.engines_reported()
    assert a.others_per_own == b.others_per_own == (6 + 3) / (2 + 1)
    assert a.load == 8
    a.inflight = 4  # two more of ours since: the other replicas are taken to send six more
    assert a.load == 4 + 6 + 3 * 2
    a.inflight = 0  # all ours answered: so are, presumably, the others' beside them
    assert a.load == 0
    b.inflight = 2
    assert b.load == 2 + 3 + 3 * 1


def test_one_replica_alone_or_with_no_report_extrapolates_nothing() -> None:
    pool = healthy_pool(["http://gpu-a:8000", "http://gpu-b:8000"])
    a, b = pool.backends
    a.inflight = 3
    a.engine_reported(engine_load(running=3, waiting=0))  # all ours
    pool.engines_reported()
    a.inflight = 9
    assert (a.others_per_own, a.load) == (0.0, 9)
    a.engine_reported(engine_load(running=50, waiting=0))
    b.engine_reported(None)
    a.inflight_at_report = a.inflight = 0  # none of ours then: no proportion to go by
    pool.engines_reported()
    assert a.others_per_own == 0.0
    a.inflight, a.inflight_at_report = 1, 1
    a.engine_reported(engine_load(running=101, waiting=0))  # 100 others beside one of ours
    pool.engines_reported()
    assert a.others_per_own == MAX_OTHERS_PER_OWN
    assert b.others_per_own == 0.0  # its engine reports nothing: its load is ours alone


async def test_health_checks_slow_down_while_no_request_is_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every interval while requests are sent; four intervals apart after a check that saw
    none since the last; the normal pace again as soon as one is sent."""
    traffic = FakeTraffic()
    checked: list[float] = []
    checker = HealthChecker(
        healthy_pool(["http://gpu:8000"]),
        None,  # type: ignore[arg-type]
        RoomMetrics.create().fleet,
        interval=3.0,
        timeout=1.0,
        traffic=traffic,
    )
    checker.check_all = noting_when(checked)  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(checker.run)
        await trio.sleep(25.0)
        assert checked == [0.0, 12.0, 24.0]
        traffic.send()  # a request at 25 s: the next check is due one interval after the last
        await trio.sleep(3.0)
        assert checked[3:] == [27.0]
        traffic.send()  # and another at 28 s
        await trio.sleep(2.5)
        assert checked[3:] == [27.0, 30.0]
        nursery.cancel_scope.cancel()
