"""The dashboard feed under a fake clock: a point a tick, serialised only while a page listens
and once per tick however many listen (each tick's payload with only its new records and
points), a slow page skipping to the newest snapshot, a failing snapshot costing a tick and not
the feed, occupancy peaks caught between ticks, a quiet proxy ticking seldom and at once when a
request comes; and the demo's traffic: bursts of large unique prompts, on request and no more
than one queued."""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

import pytest
import trio

from app.dashboard import feed as feed_module
from app.dashboard.feed import DashboardFeed
from app.http.exchange import Exchange
from app.sim.traffic import DemoTraffic
from tests.conftest import FakeTraffic, StartBackend, wait_until


class Source:
    """A runtime stand-in: snapshots whose request counter grows by 2 a call."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail_on: set[int] = set()
        self.busy = 0.0
        self.peak = 0.0

    async def build(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("a bug in a snapshot")
        total = 2 * self.calls
        recent = [{"seq": seq} for seq in range(total, max(total - 6, 0), -1)]  # a log of 6
        requests = {"total": total, "by_class": {}, "oldest_seq": max(total - 5, 1)}
        return {"requests": {**requests, "recent": recent}, "backends": []}

    def set_busy(self, busy: float) -> None:
        self.busy = busy
        self.peak = max(self.peak, busy)

    def occupancy(self) -> dict[str, float]:
        """The peak since the last call, as the runtime's dispatcher keeps it."""
        peak, self.peak = self.peak, self.busy
        return {"threads_busy": peak}


async def page_snapshot(feed: DashboardFeed) -> dict[str, Any]:
    """A fresh snapshot as a page's first one, with the time series as of the last tick."""
    snapshot: dict[str, Any] = json.loads(await feed.snapshot_bytes())
    return snapshot


async def start_feed(
    nursery: trio.Nursery, source: Source, traffic: FakeTraffic | None = None
) -> DashboardFeed:
    """A feed of `source`'s snapshots, running in `nursery`."""
    feed = DashboardFeed(
        source.build,
        source.occupancy,
        demo=False,
        write_needs_token=False,
        traffic=traffic,
        wall_clock=trio.current_time,
    )
    await nursery.start(feed.run)
    return feed


@pytest.fixture
def serialised(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = feed_module.to_json_bytes

    def counting(snapshot: Any) -> bytes:
        if "dashboard" in snapshot:  # a whole snapshot, not one of its records
            calls.append(1)
        return original(snapshot)

    monkeypatch.setattr(feed_module, "to_json_bytes", counting)
    return calls


async def test_a_point_a_tick_and_no_serialising_without_pages(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, serialised: list[int]
) -> None:
    source = Source()
    feed = await start_feed(nursery, source)
    await trio.sleep(5.5)
    assert not serialised
    series = (await page_snapshot(feed))["series"]
    assert len(series["t"]) == 6  # t = 0, 1, ..., 5
    assert series["requests_per_s"][-1] == pytest.approx(2.0)


async def test_one_serialisation_a_tick_for_every_page(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, serialised: list[int]
) -> None:
    feed = await start_feed(nursery, Source())
    received: list[list[bytes]] = [[], [], []]

    async def listen(index: int) -> None:
        async with aclosing(feed.pages_events()) as events:
            async for payload in events:
                received[index].append(payload)
                if len(received[index]) == 4:
                    return

    async with trio.open_nursery() as pages:
        for index in range(3):
            pages.start_soon(listen, index)
    # Each page's first snapshot is its own (the whole log), then the same bytes a tick.
    assert received[0][1:] == received[1][1:] == received[2][1:]
    assert len(serialised) == 3 + 3
    assert feed.pages == 0
    snapshots = [json.loads(payload) for payload in received[0]]
    assert [s["dashboard"]["pages"] for s in snapshots][1:] == [3, 3, 3]
    # A tick's payload carries the records since the tick before; the page keeps the rest.
    seqs = [[r["seq"] for r in s["requests"]["recent"]] for s in snapshots]
    assert len(seqs[0]) == min(snapshots[0]["requests"]["total"], 6)  # the log keeps 6
    assert set(range(snapshots[0]["requests"]["total"] + 1, seqs[1][0] + 1)) <= set(seqs[1])
    for before, after, sent in zip(snapshots[1:], snapshots[2:], seqs[2:], strict=False):
        assert sent == list(range(after["requests"]["total"], before["requests"]["total"], -1))
    # And the series' points since the tick before: one a tick; the page keeps the rest.
    assert "series_tail" not in snapshots[0] and len(snapshots[0]["series"]["t"]) >= 1
    tails = [s["series_tail"] for s in snapshots[1:]]
    assert all("series" not in s for s in snapshots[1:])
    assert all(len(tail["t"]) == 1 for tail in tails[1:])
    assert [tail["t"][-1] for tail in tails] == sorted({tail["t"][-1] for tail in tails})
    assert all(set(tail) == set(snapshots[0]["series"]) for tail in tails)


async def test_a_slow_page_skips_to_the_newest_snapshot(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    source = Source()
    feed = await start_feed(nursery, source)
    events = feed.pages_events()
    first = json.loads(await events.__anext__())
    await trio.sleep(5.5)  # five ticks published while this page was not reading
    newest = json.loads(await events.__anext__())
    assert newest["requests"]["total"] - first["requests"]["total"] >= 10
    read_at = trio.current_time()
    await events.__anext__()  # nothing queued behind it: the next one is the next tick's
    assert trio.current_time() - read_at >= 0.4
    await events.aclose()
    assert feed.pages == 0


async def test_a_failing_snapshot_costs_a_tick_not_the_feed(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    source = Source()
    source.fail_on = {2, 3}
    feed = await start_feed(nursery, source)
    await trio.sleep(4.5)
    series = (await page_snapshot(feed))["series"]
    assert len(series["t"]) == 3  # ticks 0, 3, 4; ticks 1 and 2 failed
    reports = [r for r in caplog.records if "tick failed" in r.getMessage()]
    assert len(reports) == 1  # rate-limited


async def test_occupancy_peaks_between_ticks_are_kept(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    source = Source()
    feed = await start_feed(nursery, source)
    await trio.sleep(1.25)
    source.set_busy(1.0)
    await trio.sleep(0.15)  # a burst between two ticks
    source.set_busy(0.0)
    await trio.sleep(1.7)
    busy = (await page_snapshot(feed))["series"]["threads_busy"]
    assert busy == [0.0, 0.0, 1.0, 0.0]  # ticks at 0, 1, 2 (the peak at 1.3), 3


async def test_a_quiet_proxy_ticks_seldom_and_at_once_when_a_request_comes(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    traffic = FakeTraffic()
    feed = await start_feed(nursery, Source(), traffic)
    await trio.sleep(2.5)  # ticks at 0 and 1; none since: quiet, the next is due at 6
    traffic.send()
    await trio.sleep(1.7)  # at once (2.5), then a second later (3.5); quiet since 3.5
    traffic.send()  # at 4.2: the tick due at 4.5 is kept, and the next a second later
    await trio.sleep(1.5)
    assert (await page_snapshot(feed))["series"]["t"] == [0.0, 1.0, 2.5, 3.5, 4.5, 5.5]
    await trio.sleep(feed_module.QUIET_TICK_S)  # quiet since 5.5
    assert (await page_snapshot(feed))["series"]["t"][6:] == [5.5 + feed_module.QUIET_TICK_S]


async def test_requests_in_flight_keep_the_pace_of_a_tick_a_second(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    traffic = FakeTraffic()
    traffic.busy = True  # long streams, none new
    feed = await start_feed(nursery, Source(), traffic)
    await trio.sleep(3.5)
    assert (await page_snapshot(feed))["series"]["t"] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("quiet", [False, True])
async def test_a_policy_change_is_published_before_the_next_tick(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, quiet: bool
) -> None:
    source = Source()
    feed = await start_feed(nursery, source, FakeTraffic() if quiet else None)
    events = feed.pages_events()
    await events.__anext__()
    await trio.sleep(1.3 if quiet else 0.3)  # quiet: past the second tick, none due for 5 s
    started = trio.current_time()
    feed.poke()
    await events.__anext__()
    assert trio.current_time() - started < feed.tick_s / 2
    await events.aclose()


class CountingBackend:
    """An OpenAI-ish backend that records each request's path and body size."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, str]] = []

    async def __call__(self, exchange: Exchange) -> None:
        body = json.loads(await exchange.read_body(1 << 24))
        prompt = body.get("prompt", "")
        self.seen.append((exchange.path, len(prompt), prompt[:20]))
        answer = {"choices": [{"message": {"content": "ok"}, "text": "ok"}]}
        await exchange.respond_json(200, answer)

    def bursts(self) -> list[tuple[str, int, str]]:
        return [s for s in self.seen if s[0] == "/v1/completions"]


async def test_demo_bursts_on_request_large_and_unique(
    start_backend: StartBackend, nursery: trio.Nursery
) -> None:
    backend = CountingBackend()
    url = await start_backend(backend)
    traffic = DemoTraffic(0.01, burst_interval=0, models=("m",), burst_size=4)
    assert traffic.request_burst() is True
    assert traffic.request_burst() is False  # one already asked for
    nursery.start_soon(traffic.run, url)

    async def burst_arrived(count: int) -> bool:
        return len(backend.bursts()) >= count

    await wait_until(lambda: burst_arrived(4), timeout=10)
    bursts = backend.bursts()
    assert all(size > 50_000 for _, size, _ in bursts)
    assert len({start for _, _, start in bursts}) == 4  # unique from the first word on
    assert traffic.request_burst() is True
    await wait_until(lambda: burst_arrived(8), timeout=10)
    assert traffic.bursts_sent == 2
