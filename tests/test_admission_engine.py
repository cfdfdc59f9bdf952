"""Admission driven through the simulated GPU's step model, on trio's autojump clock.

The proxy's decision runs as in `sluice serve` (the router, its gate and fair queue, the
saturation judge, each engine's room, and the load scraper reading the engine's own
Prometheus text every 0.5 s), in front of simulated engines (app/sim/engine.py: vLLM's
continuous batching with chunked prefill) played out in virtual time, with no HTTP between:
one of our requests asks the router, runs on its engine, says when its first token came and
ends; another sender's goes straight to the engine.

In every scenario no time is spent holding a request while its engine reported room: a
report asked for after our last change on it that shows fewer sequences running than the
engine's own `max_num_seqs` and an empty queue. This is counted here, from the reports and
our own requests as the rig saw them, and the proxy's own count must agree (both zero, not
small). Where only our requests reach an engine, no time is spent holding one while the
engine itself (not its report) had a free sequence and an empty queue either.

- after a burst of 1-token chats from 32 clients, ours or another sender's, 20 streams/s of
  64 tokens are never held and start as fast as straight to an idle engine;
- on an engine of 4 sequences, a light key's short streams beside a heavy key's 32 clients:
  at most one of ours waits in the engine's queue, and the light key's first tokens come
  within a few streams' time;
- another sender keeps an engine full with a queue: one of ours at a time waits in that
  queue (so ours are served at one per pass through the others' queue), none starved;
- an engine restarted with fewer sequences, then with more: its room is learnt again (fewer)
  or unknown until it refuses again (more).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
import trio.testing

from app.cli.rooms import RoomMetrics, router_settings
from app.config import Settings
from app.fleet.load_scraper import LoadScraper
from app.fleet.pool import BackendPool
from app.fleet.saturation import queued_ours
from app.http.fetch import Fetched, Fetcher
from app.http.fields import Headers
from app.routing.admission import Admission
from app.routing.decision import RouteRequest
from app.routing.router import Router
from app.sim.engine import SimEngine
from app.sim.metrics import SimMetrics
from app.sim.server import STATED_LIMIT_PATHS, stated_about
from app.sim.settings import SimSettings

URL = "http://gpu-0:8000"
POLL_S = 0.002  # the rig's watch of holding against room, in virtual time


@dataclass
class Report:
    at: float
    running: int
    waiting: int


@dataclass
class Stream:
    ttft: float
    held: float
    tenant: str


class Rig(Fetcher):
    """One simulated engine behind the router; its /metrics (and where it states its limit)
    answered in process, each answer noted as a report."""

    def __init__(self, nursery: trio.Nursery, settings: SimSettings) -> None:
        super().__init__(connect_timeout=1.0)
        self.nursery = nursery
        self.pool = BackendPool((URL,), failures_to_open=3, cooldown=10.0, probe_path="/health")
        self.pool.backends[0].healthy = True
        self.backend = self.pool.backends[0]
        self.metrics = RoomMetrics.create()
        self.router = Router(
            router_settings(Settings(policy="round_robin")), self.pool, self.metrics.routing
        )
        self.reports: list[Report] = []
        self.last_change = -1.0  # our last request sent, started or ended
        self.held_with_room = 0.0  # held while a fresh report showed room (this rig's count)
        self.held_with_free_engine = 0.0  # held while the engine itself had room
        self.most_queued = 0  # the most of ours the proxy judged waiting in the engine's queue
        self._engine_scope = trio.CancelScope()
        self.settings = settings
        self.engine = SimEngine(settings)
        self._exposition = SimMetrics(self.engine, settings)

    async def start(self) -> None:
        await self.nursery.start(self._run_engine, self.engine, self._engine_scope)
        await self.nursery.start(self.router.run)
        scraper = LoadScraper(
            self.pool, self, timeout=1.0, traffic=self.router, reported=self.router.gate.opened
        )
        self.nursery.start_soon(scraper.run)
        self.nursery.start_soon(self._watch)

    @staticmethod
    async def _run_engine(
        engine: SimEngine, scope: trio.CancelScope, *, task_status: trio.TaskStatus[None]
    ) -> None:
        with scope:
            await engine.run(task_status=task_status)

    async def restart(self, settings: SimSettings) -> None:
        """The engine process replaced by one with `settings` (its requests are lost)."""
        self._engine_scope.cancel()
        self._engine_scope = trio.CancelScope()
        self.settings = settings
        self.engine = SimEngine(settings)
        self._exposition = SimMetrics(self.engine, settings)
        await self.nursery.start(self._run_engine, self.engine, self._engine_scope)

    async def exchange(
        self, base_url: str, path: str, method: bytes, body: bytes, headers: Headers | None = None
    ) -> Fetched:
        await trio.lowlevel.checkpoint()
        if path == "/metrics":
            engine = self.engine
            self.reports.append(Report(trio.current_time(), engine.running, engine.waiting))
            return Fetched(200, self._exposition.exposition())
        if path == STATED_LIMIT_PATHS.get(self.settings.metrics_style):
            return Fetched(200, __import__("json").dumps(stated_about(self.settings)).encode())
        return Fetched(404, b"{}")

    def changed(self) -> None:
        self.last_change = trio.current_time()

    def reports_room(self) -> bool:
        """The last report was asked for after our last change, and shows room."""
        if not self.reports:
            return False
        last = self.reports[-1]
        return (
            last.at > self.last_change
            and last.waiting == 0
            and last.running < self.settings.max_num_seqs
        )

    async def _watch(self) -> None:
        while True:
            await trio.sleep(POLL_S)
            held = self.router.gate.held > 0
            if held and self.reports_room():
                self.held_with_room += POLL_S
            engine = self.engine
            if held and engine.waiting == 0 and engine.running < self.settings.max_num_seqs:
                self.held_with_free_engine += POLL_S
            self.most_queued = max(self.most_queued, queued_ours(self.backend, trio.current_time()))

    async def ours(
        self, tenant: str, prompt: list[int], tokens: int, streams: list[Stream] | None = None
    ) -> None:
        """One of our requests, through the router, to its end."""
        asked = trio.current_time()
        decision = await self.router.choose(RouteRequest(text=tenant), (), Admission(tenant))
        assert decision is not None
        self.changed()
        first: list[float] = []

        async def emit(_index: int) -> None:
            if not first:
                first.append(trio.current_time())
                self.router.started(decision)
                self.changed()

        try:
            await self.engine.generate(prompt, tokens, emit)
        finally:
            self.router.release(decision, None)
            self.changed()
        if streams is not None:
            streams.append(Stream(first[0] - asked, decision.waited, tenant))

    def proxy_held_with_room(self) -> float:
        return sum(self.metrics.routing.admission.held_with_room_s.values())


@dataclass
class Clients:
    """Closed-loop clients, each sending its next request when the last one ended."""

    rig: Rig
    send: Callable[[], Awaitable[None]]
    count: int
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def start(self) -> None:
        self.rig.nursery.start_soon(self._run)

    async def _run(self) -> None:
        with self.scope:
            async with trio.open_nursery() as nursery:
                for _ in range(self.count):
                    nursery.start_soon(self._loop)

    async def _loop(self) -> None:
        while True:
            await self.send()

    def stop(self) -> None:
        self.scope.cancel()


def prompt(rng: random.Random, length: int = 24) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(length)]


async def poisson_streams(
    rig: Rig, rate: float, seconds: float, seed: int, direct: bool = False
) -> list[Stream]:
    """`rate` streams a second of 64 tokens for `seconds`, ours (or straight to the engine)."""
    rng = random.Random(seed)
    streams: list[Stream] = []

    async def straight(text: list[int]) -> None:
        asked = trio.current_time()
        first: list[float] = []

        async def emit(_index: int) -> None:
            if not first:
                first.append(trio.current_time())

        await rig.engine.generate(text, 64, emit)
        streams.append(Stream(first[0] - asked, 0.0, "direct"))

    async with trio.open_nursery() as nursery:
        end = trio.current_time() + seconds
        while (now := trio.current_time()) < end:
            text = prompt(rng)
            if direct:
                nursery.start_soon(straight, text)
            else:
                nursery.start_soon(rig.ours, "streams", text, 64, streams)
            await trio.sleep_until(now + rng.expovariate(rate))
    return streams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def rig_with(nursery: trio.Nursery, **overrides: object) -> Rig:
    rig = Rig(nursery, SimSettings(**overrides))  # type: ignore[arg-type]
    await rig.start()
    await trio.testing.wait_all_tasks_blocked()  # its first report read
    return rig


async def burst_then_streams(
    nursery: trio.Nursery, burst_through_proxy: bool
) -> tuple[Rig, list[Stream], list[Stream]]:
    """32 clients' 1-token chats for 10 s (ours or another sender's), then 20 streams/s of 64
    tokens through the proxy; and the same burst and streams straight to an engine of its
    own."""

    async def one(rig: Rig, through_proxy: bool, direct: bool) -> list[Stream]:
        rng = random.Random(1)

        async def chat() -> None:
            if through_proxy:
                await rig.ours("burst", prompt(rng), 1)
            else:
                await rig.engine.generate(prompt(rng), 1, _ignore)

        burst = Clients(rig, chat, 32)
        burst.start()
        await trio.sleep(10.0)
        burst.stop()
        return await poisson_streams(rig, 20.0, 10.0, seed=2, direct=direct)

    rig, direct_rig = await rig_with(nursery), await rig_with(nursery)
    results: dict[bool, list[Stream]] = {}

    async def run(rig: Rig, direct: bool) -> None:
        results[direct] = await one(rig, burst_through_proxy and not direct, direct)

    async with trio.open_nursery() as both:
        both.start_soon(run, rig, False)
        both.start_soon(run, direct_rig, True)
    return rig, results[False], results[True]


async def _ignore(_index: int) -> None:
    pass


def never_held_with_room(rig: Rig) -> None:
    assert rig.held_with_room == 0.0
    assert rig.proxy_held_with_room() == 0.0


async def test_after_a_burst_of_our_own_short_chats_streams_are_never_held(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig, streams, direct = await burst_then_streams(nursery, burst_through_proxy=True)
    never_held_with_room(rig)
    assert rig.held_with_free_engine == 0.0
    room = rig.backend.room
    assert room.room is None or room.room >= room.most  # never below what it ran
    assert [s for s in streams if s.held > 0] == []
    ttft, straight = [s.ttft for s in streams], [s.ttft for s in direct]
    assert percentile(ttft, 0.5) <= percentile(straight, 0.5)
    assert percentile(ttft, 0.99) <= percentile(straight, 0.99)


async def test_after_another_senders_burst_streams_are_never_held(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig, streams, direct = await burst_then_streams(nursery, burst_through_proxy=False)
    never_held_with_room(rig)
    assert [s for s in streams if s.held > 0] == []
    ttft, straight = [s.ttft for s in streams], [s.ttft for s in direct]
    assert percentile(ttft, 0.99) <= percentile(straight, 0.99)


async def test_short_streams_of_a_light_key_beside_a_heavy_one_on_a_small_engine(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """16 tokens at 20 ms on an engine of 4: a stream is shorter than a scrape interval."""
    rig = await rig_with(
        nursery, max_num_seqs=4, inter_token_latency=0.02, time_factor_under_load=1.0
    )
    rng = random.Random(3)
    light: list[Stream] = []
    heavy = Clients(rig, lambda: rig.ours("heavy", prompt(rng), 16), 32)
    heavy.start()
    await trio.sleep(6.0)  # its room learnt from the flood's queue, and that queue drained
    assert rig.backend.room.room == 4
    rig.most_queued = 0
    alone = Clients(rig, lambda: rig.ours("light", prompt(rng), 16, light), 1)
    alone.start()
    await trio.sleep(20.0)
    alone.stop()
    heavy.stop()
    never_held_with_room(rig)
    assert rig.held_with_free_engine == 0.0
    assert rig.most_queued <= 1  # one of ours at most in the engine's own queue
    one_stream = 0.005 + 15 * 0.02
    assert percentile([s.ttft for s in light], 0.99) <= 2.5 * one_stream
    assert len(light) >= 20.0 / (2 * one_stream)


async def test_another_senders_full_engine_takes_ours_one_at_a_time_and_starves_none(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await rig_with(nursery, max_num_seqs=8, inter_token_latency=0.01)
    rng = random.Random(4)
    others = Clients(rig, lambda: rig.engine.generate(prompt(rng), 32, _ignore), 24)
    others.start()
    done: list[Stream] = []
    ours = Clients(rig, lambda: rig.ours("ours", prompt(rng), 32, done), 6)
    ours.start()
    await trio.sleep(5.0)  # the engine read while ours flow: the others' queue at its most
    assert rig.backend.room.room == 8
    rig.most_queued, done[:] = 0, []
    await trio.sleep(20.0)
    ours.stop()
    others.stop()
    never_held_with_room(rig)
    assert rig.most_queued == 1
    # Served one at a time through the others' queue (16 long): each in about the time a
    # request waits there, none held until its deadline.
    queue_wait = 16 / (8 / (32 * 0.01 * 2.0))  # its queue over its rate at a full batch
    assert len(done) >= 0.5 * 20.0 / queue_wait
    assert max(s.ttft for s in done) < Settings().admission_timeout


async def test_an_engine_restarted_with_fewer_then_more_sequences_is_learnt_again(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await rig_with(nursery, max_num_seqs=16, inter_token_latency=0.01)
    rng = random.Random(5)
    ours = Clients(rig, lambda: rig.ours("ours", prompt(rng), 32), 24)
    ours.start()
    await trio.sleep(4.0)
    assert rig.backend.room.room == 16
    ours.stop()
    await trio.testing.wait_all_tasks_blocked()
    await rig.restart(SimSettings(max_num_seqs=4, inter_token_latency=0.01))
    ours = Clients(rig, lambda: rig.ours("ours", prompt(rng), 32), 24)
    ours.start()
    await trio.sleep(6.0)  # the restart seen, the smaller room learnt, what it queued drained
    assert rig.backend.room.room == 4
    rig.most_queued = 0
    await trio.sleep(2.0)
    assert rig.most_queued <= 1
    ours.stop()
    await trio.testing.wait_all_tasks_blocked()
    await rig.restart(SimSettings(max_num_seqs=32, inter_token_latency=0.01))
    ours = Clients(rig, lambda: rig.ours("ours", prompt(rng), 32), 24)
    ours.start()
    await trio.sleep(4.0)
    ours.stop()
    assert rig.backend.room.room is None  # never seen refusing since: unknown
    assert rig.engine.running == 0 or rig.backend.room.most >= 24  # ran all of ours at once
    never_held_with_room(rig)


async def test_a_stated_limit_is_the_room_from_the_first_report(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    rig = await rig_with(nursery, max_num_seqs=6, metrics_style="sglang")
    rng = random.Random(6)
    ours = Clients(rig, lambda: rig.ours("ours", prompt(rng), 32), 12)
    ours.start()
    await trio.sleep(1.0)
    room = rig.backend.room
    assert (room.room, room.basis) == (6, "stated")
    assert rig.most_queued == 1
    ours.stop()
    never_held_with_room(rig)
