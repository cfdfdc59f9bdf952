"""Admission by the engines' own signals, fair across keys.

The pure pieces alone: `FairQueue` (priority bands, start-time fair queuing by weight, the two
bounds and push-out, the affinity window), `fair_shares` (max-min by weight), an engine's room
learnt from its reports (`learnt_capacity`) and the saturation judge. Then the gate that
holds requests (routing/gate.py) on a real `BackendPool` whose engines' reports the tests set,
under trio's autojump clock: a request passes at once while an engine has room and is held
while none has; what leaves when room appears is the fairest request, routed then (late
binding), preferring one whose prefix the engine with room holds; a deadline answers 429 at
exactly its time; a request cancelled while held leaves nothing behind, and one cancelled
after it was routed gives its reservation back. Last, the running router: a long prompt's
blocks hashed in a thread and recorded behind it, and a held request counted as traffic (the
watchers that pace themselves by it wake).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from app.config import Settings
from app.fleet.backends import PROBE_BACKOFF_REPORTS, Backend, BackendPool, learnt_capacity
from app.fleet.engine_metrics import EngineLoad
from app.fleet.saturation import saturation
from app.observe.admission_stats import AdmissionStats, fair_shares
from app.observe.metrics import Metrics
from app.routing.admission import CONTENDED_S, Admission, FairQueue, Held, Overloaded
from app.routing.cache_aware import CacheAware
from app.routing.decision import Decision, RouteRequest
from app.routing.gate import Gate, GateLimits
from app.routing.router import Router
from tests.conftest import wait_until

# --- the fair queue ---------------------------------------------------------------------------


def held(tenant: str, at: float = 0.0, weight: float = 1.0, priority: int = 0) -> Held:
    return Held(tenant, weight, priority, at)


def order(queue: FairQueue) -> list[str]:
    out = []
    while (next_one := queue.pop()) is not None:
        out.append(next_one.tenant)
    return out


def test_a_light_tenant_never_waits_behind_a_heavy_ones_backlog() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    for i in range(10):
        queue.push(held("heavy", at=i))
    queue.push(held("light", at=10))
    assert order(queue)[:2] == ["heavy", "light"]


def test_weights_share_what_leaves() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    for i in range(12):
        queue.push(held("two", at=i, weight=2.0))
        queue.push(held("one", at=i, weight=1.0))
    first = order(queue)[:12]
    assert first.count("two") == 8 and first.count("one") == 4


def test_an_idle_tenant_comes_back_without_credit() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    for i in range(6):
        queue.push(held("busy", at=i))
    for _ in range(4):
        queue.pop()
    queue.push(held("back", at=10))  # idle all along: it starts at the present
    queue.push(held("back", at=11))
    # It starts where fair time is now, level with busy's next, not four turns back.
    assert order(queue) == ["back", "busy", "back", "busy"]


def test_a_lower_band_leaves_first_whoever_sent_it() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    queue.push(held("a", at=0, priority=1))
    queue.push(held("b", at=1, priority=0))
    assert queue.holds_ahead_of(0) and not queue.holds_ahead_of(-1)
    assert order(queue) == ["b", "a"]


def test_a_tenant_over_its_bound_is_refused_and_a_full_queue_sheds_the_heaviest() -> None:
    queue = FairQueue(max_held=4, max_per_tenant=3)
    first = [held("heavy", at=i) for i in range(3)]
    for entry in first:
        assert queue.push(entry) is None
    assert queue.push(held("light", at=3)) is None
    over = held("heavy", at=4)
    assert queue.push(over) is over  # its own bound, others holding too
    pushed_out = queue.push(held("other", at=5))
    assert pushed_out is first[-1]  # the queue was full: the heaviest's newest made room
    late = held("light", at=6)
    assert queue.push(late) is late  # no tenant holds more than one more than light
    assert len(queue) == 4 and queue.held_by("heavy") == 2


def test_a_tenant_alone_may_hold_the_whole_queue_and_is_pushed_out_when_others_come() -> None:
    """Nobody to protect: the anonymous tenant of a proxy without keys, bursting, is held
    up to the queue's bound, not its own; a newcomer of another tenant then makes room."""
    queue = FairQueue(max_held=4, max_per_tenant=2)
    burst = [held("anonymous", at=i) for i in range(4)]
    for entry in burst:
        assert queue.push(entry) is None
    over = held("anonymous", at=4)
    assert queue.push(over) is over  # the queue's own bound
    assert queue.push(held("key-1", at=5)) is burst[-1]
    late = held("anonymous", at=6)
    assert queue.push(late) is late  # over its own bound, now that another key sends too
    assert order(queue) == ["anonymous", "key-1", "anonymous", "anonymous"]


def test_a_key_that_sent_lately_binds_the_others_though_none_of_its_requests_is_held() -> None:
    """A light key's requests leave first and are seldom held: its coming within the last
    CONTENDED_S is what binds a heavy key to its bound, not its held requests."""
    queue = FairQueue(max_held=8, max_per_tenant=2)
    queue.push(held("light", at=0.0))
    assert order(queue) == ["light"]  # it left at once
    for at in (1.0, 2.0):
        assert queue.push(held("heavy", at=at)) is None
    over = held("heavy", at=3.0)
    assert queue.push(over) is over  # light came 3 s ago
    quiet = held("heavy", at=CONTENDED_S + 0.5)
    assert queue.push(quiet) is None  # light quiet for longer: heavy is alone


def test_the_affinity_window_bends_fairness_by_a_few_places_only() -> None:
    queue = FairQueue(max_held=100, max_per_tenant=100)
    for i, tenant in enumerate("abcdef"):
        entry = held(tenant, at=i)
        entry.prefers = "gpu-2" if tenant in "cf" else None
        queue.push(entry)
    wants_gpu_2 = lambda entry: entry.prefers == "gpu-2"  # noqa: E731
    first = queue.pop(prefer=wants_gpu_2, window=4)
    assert first is not None and first.tenant == "c"
    second = queue.pop(prefer=wants_gpu_2, window=2)  # f is 5th in order: out of reach
    assert second is not None and second.tenant == "a"


def test_fair_shares_are_max_min_by_weight() -> None:
    assert fair_shares({"a": 10, "b": 100}, {}, 60) == {"a": 10.0, "b": 50.0}
    assert fair_shares({"a": 100, "b": 100}, {"a": 3.0}, 80) == {"a": 60.0, "b": 20.0}
    assert fair_shares({"a": 0, "b": 5}, {}, 5) == {"a": 0.0, "b": 5.0}


# --- an engine's room, from its own reports -----------------------------------------------------


def test_room_is_what_an_engine_ran_while_others_waited_and_grows_when_it_never_queued() -> None:
    # learnt_capacity(capacity, proven, running, waiting, running at the report before)
    assert learnt_capacity(None, 12, 12, 0, 0) is None  # never full: unknown, nothing held
    assert learnt_capacity(None, 4, 4, 9, 4) == 4  # a queue it does not take in: full
    assert learnt_capacity(None, 50, 50, 150, 0) is None  # a burst it is taking in: not full
    assert learnt_capacity(4, 4, 4, 0, 4) == 5  # ran all it was thought to hold: one more
    assert learnt_capacity(64, 64, 64, 0, 60) == 72  # an eighth more
    assert learnt_capacity(6, 6, 3, 0, 6) == 6
    assert learnt_capacity(5, 4, 4, 1, 4) == 4  # the probe waited: back to what it ran
    assert learnt_capacity(200, 200, 190, 3, 195) == 200  # never below the most it ran


def reported(backend: Backend, running: int, waiting: int, kv: float | None = None) -> None:
    backend.engine_reported(EngineLoad("vllm", running, waiting, kv, None))


def full(backend: Backend, room: int) -> None:
    """Two reports of an engine running `room` with a queue it does not take in: full."""
    reported(backend, room, 1)
    reported(backend, room, 1)


def test_a_probe_of_more_room_is_flagged_and_not_repeated_once_it_found_the_end() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    backend.inflight = 4
    full(backend, 4)  # its room: 4
    reported(backend, 4, 0)  # ran all 4, none waiting: probe one more
    assert (backend.capacity, backend.proven) == (5, 4)
    backend.inflight = 3
    assert not backend.probing  # a slot it was seen to run
    backend.inflight = 4
    assert backend.probing  # the fifth would go past what it ran: a probe
    backend.inflight = 5
    reported(backend, 4, 1)  # the probe waited at the engine: its room's end, found
    assert backend.capacity == 4
    backend.inflight = 4
    for _ in range(PROBE_BACKOFF_REPORTS):
        reported(backend, 4, 0)
        assert backend.capacity == 4  # not probed again for a while
    reported(backend, 4, 0)
    assert backend.capacity == 5


def test_a_probe_goes_to_the_tenant_holding_the_most() -> None:
    queue = FairQueue(100, 100)
    for tenant, count in (("light", 1), ("heavy", 5)):
        for _ in range(count):
            queue.push(Held(tenant, 1.0, 0, 0.0))
    assert queue.pop(heaviest=True).tenant == "heavy"  # type: ignore[union-attr]
    assert queue.pop().tenant == "light"  # type: ignore[union-attr]


def test_saturation_follows_the_engine_and_what_the_proxy_sent_since() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    assert saturation(backend, None, 0.95) is None  # no report: the engine decides
    backend.inflight = 5
    reported(backend, 4, 1)  # 4 run, 1 waits, as it takes more in: not full yet
    assert backend.capacity is None and saturation(backend, None, 0.95) is None
    reported(backend, 4, 1)  # it takes no more in: its room is 4
    assert backend.capacity == 4 and saturation(backend, None, 0.95) == "full"
    backend.inflight = 3  # two of ours ended since: 3 on it
    assert saturation(backend, None, 0.95) is None
    backend.inflight = 4
    assert saturation(backend, None, 0.95) == "full"
    assert saturation(backend, 4, 0.95) == "ceiling"
    reported(backend, 3, 0, kv=0.97)
    assert saturation(backend, None, 0.95) == "kv"
    backend.inflight = 3  # nothing ended since that report


# --- the gate -----------------------------------------------------------------------------------


def pool_of(count: int, room: int) -> BackendPool:
    """Healthy backends whose engines have reported a room of `room` requests, idle."""
    pool = BackendPool(
        tuple(f"http://gpu-{i}:8000" for i in range(count)),
        failures_to_open=3,
        cooldown=10.0,
        probe_path="/health",
    )
    for backend in pool.backends:
        backend.healthy = True
        full(backend, room)  # seen full once: its room is known
        reported(backend, 0, 0)
    return pool


class Routes:
    """The router's part: pick a backend (the first, or the preferred prefix holder's) and
    reserve it; give reservations back."""

    def __init__(self) -> None:
        self.holder: dict[str, str] = {}  # request text -> backend URL holding its prefix
        self.routed: list[tuple[str, str]] = []

    def route(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        wanted = self.holder.get(request.text or "")
        backend = next((b for b in candidates if b.url == wanted), candidates[0])
        backend.inflight += 1
        self.routed.append((request.text or "", backend.url))
        return Decision(backend, "test")

    def prefers(self, candidates: Sequence[Backend], request: RouteRequest) -> Backend | None:
        wanted = self.holder.get(request.text or "")
        return next((b for b in candidates if b.url == wanted), None)

    def give_back(self, decision: Decision) -> None:
        decision.backend.inflight -= 1


def gate_for(pool: BackendPool, routes: Routes, timeout: float = 30.0) -> Gate:
    stats = AdmissionStats(lambda *_: None, lambda *_: None, lambda *_: None, trio.current_time)
    limits = GateLimits(None, 0.95, max_held=8, max_per_tenant=8, timeout=timeout)
    return Gate(pool, routes.route, routes.give_back, limits, stats, prefers=routes.prefers)


def done(gate: Gate, decision: Decision) -> None:
    """Its answer ended: the backend has room again."""
    decision.backend.inflight -= 1
    gate.opened([None])


async def test_a_request_passes_while_an_engine_has_room_and_is_held_once_none_has() -> None:
    pool, routes = pool_of(1, room=2), Routes()
    gate = gate_for(pool, routes)
    first = await gate.enter(RouteRequest(text="1"), (), Admission("a"))
    second = await gate.enter(RouteRequest(text="2"), (), Admission("a"))
    assert first is not None and second is not None and gate.held == 0
    results: list[str] = []

    async def enter(text: str, tenant: str) -> None:
        decision = await gate.enter(RouteRequest(text=text), (), Admission(tenant))
        assert decision is not None
        results.append(text)

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(enter, f"heavy-{i}", "heavy")
            await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(enter, "light", "light")
        await trio.testing.wait_all_tasks_blocked()
        assert gate.held == 5 and results == []
        done(gate, first)  # room for one: the heavy key's first, then the light one
        await trio.testing.wait_all_tasks_blocked()
        done(gate, second)
        await trio.testing.wait_all_tasks_blocked()
        assert results == ["heavy-0", "light"]
        nursery.cancel_scope.cancel()


async def test_a_held_request_goes_where_its_prefix_is_when_that_engine_has_room() -> None:
    pool, routes = pool_of(2, room=1), Routes()
    gpu_0, gpu_1 = pool.backends
    gate = gate_for(pool, routes)
    on_0 = await gate.enter(RouteRequest(text="x"), (), Admission("a"))
    on_1 = await gate.enter(RouteRequest(text="y"), (), Admission("a"))
    assert on_0 is not None and on_1 is not None
    routes.holder["p1"] = gpu_1.url
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.enter, RouteRequest(text="p0"), (), Admission("a"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(gate.enter, RouteRequest(text="p1"), (), Admission("b"))
        await trio.testing.wait_all_tasks_blocked()
        done(gate, on_1)  # gpu-1 has room: p1, whose prefix it holds, goes there first
        await trio.testing.wait_all_tasks_blocked()
        assert routes.routed[-1] == ("p1", gpu_1.url) and gate.held == 1
        nursery.cancel_scope.cancel()
    assert gpu_0.inflight == 1


async def test_a_held_request_is_refused_at_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, routes = pool_of(1, room=1), Routes()
    gate = gate_for(pool, routes, timeout=30.0)
    assert await gate.enter(RouteRequest(text="1"), (), Admission("a")) is not None
    started = trio.current_time()
    with pytest.raises(Overloaded) as late:
        await gate.enter(RouteRequest(text="2"), (), Admission("a"))
    assert trio.current_time() - started == 30.0
    assert late.value.reason == "queue_timeout" and late.value.status == 429
    client_deadline = Admission("a", deadline=trio.current_time() + 2.5)
    started = trio.current_time()
    with pytest.raises(Overloaded):
        await gate.enter(RouteRequest(text="3"), (), client_deadline)
    assert trio.current_time() - started == 2.5
    assert gate.held == 0


async def test_cancelled_requests_leave_nothing_held_and_nothing_reserved() -> None:
    pool, routes = pool_of(1, room=1), Routes()
    (backend,) = pool.backends
    gate = gate_for(pool, routes)
    first = await gate.enter(RouteRequest(text="1"), (), Admission("a"))
    assert first is not None
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gate.enter, RouteRequest(text="gone"), (), Admission("a"))
            await trio.testing.wait_all_tasks_blocked()
            assert gate.held == 1
            scope.cancel()
    assert gate.held == 0
    # Cancelled, then routed before its task ran: the reservation goes back.
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gate.enter, RouteRequest(text="late"), (), Admission("a"))
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()  # delivered to the held task, which has not run since
            done(gate, first)  # still in the queue: routed, inflight back to 1
            assert backend.inflight == 1
    assert backend.inflight == 0 and gate.held == 0


async def test_held_requests_learn_when_no_backend_of_their_pool_is_left() -> None:
    pool, routes = pool_of(1, room=1), Routes()
    (backend,) = pool.backends
    gate = gate_for(pool, routes)
    assert await gate.enter(RouteRequest(text="1"), (), Admission("a")) is not None
    outcome: list[Decision | None] = []

    async def enter() -> None:
        outcome.append(await gate.enter(RouteRequest(text="2"), (), Admission("a")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(enter)
        await trio.testing.wait_all_tasks_blocked()
        backend.healthy = False
        gate.opened()
    assert outcome == [None] and gate.held == 0


def test_no_deadline_by_default() -> None:
    assert Admission().deadline == math.inf


# --- the router ---------------------------------------------------------------------------------


async def test_a_running_router_hashes_a_long_prompt_in_a_thread_and_records_it_behind(
    nursery: trio.Nursery,
) -> None:
    """Routing a 20,000-token prompt costs the loop no pass over its blocks: their hashes
    come from a thread, and the router's own task records them a slice at a time."""
    pool = pool_of(2, room=8)
    router = Router(Settings(), pool, Metrics())
    await nursery.start(router.run)
    policy = router.policy
    assert isinstance(policy, CacheAware)
    request = RouteRequest(token_ids=array("I", range(20_000)))
    decision = await router.choose(request)
    assert decision is not None and request.block_hashes is not None
    assert len(request.block_hashes) == 1250
    # Recorded behind the request, not during it.
    assert policy.pending and len(policy.index) < 1250

    async def recorded() -> bool:
        return len(policy.index) == 1250 and not policy.pending

    await wait_until(recorded)
    router.release(decision, None)
    again = await router.choose(RouteRequest(token_ids=array("I", range(20_000))))
    assert again is not None and again.reason == "prefix-hit"
    assert again.backend is decision.backend


async def test_a_request_held_on_a_quiet_spells_report_wakes_the_fleets_watchers(
    nursery: trio.Nursery,
) -> None:
    """An engine last read while other senders filled it holds this proxy's next request; that
    request is traffic all the same, so the load scraper idling on the stale report reads
    the engine at once. Measured (bench streams: others' 200 streams gone, this proxy's 50
    starting), requests held on such a report waited ~2 s for the next idle scrape."""
    pool = pool_of(1, room=4)
    (gpu,) = pool.backends
    reported(gpu, 4, 1)  # others' requests: all it runs, and one waiting
    router = Router(Settings(), pool, Metrics())
    await nursery.start(router.run)
    woken = trio.Event()

    async def watch() -> None:
        await router.next_request()
        woken.set()

    async def send() -> None:
        decision = await router.choose(RouteRequest(text="hello"))
        assert decision is not None and decision.backend is gpu

    nursery.start_soon(watch)
    await trio.testing.wait_all_tasks_blocked()
    assert not router.busy
    nursery.start_soon(send)
    await trio.testing.wait_all_tasks_blocked()
    assert woken.is_set() and router.requests == 1
    assert router.gate.held == 1 and router.busy
    reported(gpu, 0, 0)  # read at once: the others' requests are gone
    router.gate.opened()
    await trio.testing.wait_all_tasks_blocked()
    assert router.gate.held == 0 and gpu.inflight == 1
