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
from app.fleet.backends import Asked, Backend, BackendPool
from app.fleet.engine_metrics import EngineLoad
from app.fleet.room import REFUSALS_TO_LEARN, EngineRoom, Seen
from app.fleet.saturation import (
    PROBE_EVERY_S,
    queue_allowance,
    queued_ours,
    reports_room,
    saturation,
)
from app.observe.admission_stats import AdmissionStats, fair_shares
from app.observe.metrics import Metrics
from app.routing.admission import CONTENDED_S, Admission, FairQueue, Held
from app.routing.cache_aware import CacheAware
from app.routing.decision import Decision, RouteRequest
from app.routing.gate import ANTICIPATE_S, Gate, GateLimits
from app.routing.refusal import Overloaded
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


def refusing(room: EngineRoom, running: int, waiting: int, reports: int) -> None:
    """Reports of a queue while one of ours waited unstarted all along."""
    for _ in range(reports):
        room.reported(Seen(running, waiting, True))


def test_a_room_is_learnt_only_from_a_queue_held_at_the_most_the_engine_ran() -> None:
    room = EngineRoom()
    refusing(room, 4, 9, REFUSALS_TO_LEARN - 1)
    assert room.room is None and room.basis == "unknown"  # not yet: could be a step's wait
    room.reported(Seen(4, 9, False, queue_wait_s=0.4, step_s=0.02))  # 20 steps in its queue
    assert (room.room, room.basis) == (4, "seen-full")
    assert "ran 4 with 9 waiting" in room.why


def test_a_queue_while_the_running_count_moves_or_below_its_most_teaches_nothing() -> None:
    """Chunked prefill: requests wait a step for the token budget while others finish, so
    the running count moves under a queue (measured: read as a full engine, a burst of
    1-token chats left a room of 9 on an engine of 32)."""
    room = EngineRoom()
    room.reported(Seen(20, 0, True))
    for running in (9, 12, 7, 9, 11, 9, 9, 9):  # below the 20 it ran: a KV-bound or step wait
        room.reported(Seen(running, 5, True))
    assert room.room is None
    for running in (20, 19, 20, 18, 20):  # at its most, but moving
        room.reported(Seen(running, 3, True))
    assert room.room is None
    for _ in range(5):  # steady at its most, but none of ours waited from one report to the next
        room.reported(Seen(20, 12, False))
    for _ in range(5):  # nor did the engine's own requests wait more than a step or two
        room.reported(Seen(20, 12, False, queue_wait_s=0.03, step_s=0.02))
    assert room.room is None
    refusing(room, 20, 3, REFUSALS_TO_LEARN)
    assert room.room == 20


def test_a_room_is_never_below_what_the_engine_ran_and_grows_when_it_runs_more() -> None:
    room = EngineRoom()
    refusing(room, 4, 2, REFUSALS_TO_LEARN)
    assert room.room == 4
    room.reported(Seen(3, 4, True))  # a queue below its room: never lowers it
    room.reported(Seen(4, 0, True))
    assert room.room == 4
    room.reported(Seen(6, 0, True))  # ran more than its room: it had more, how much is unknown
    assert (room.room, room.basis) == (None, "unknown")
    refusing(room, 8, 1, REFUSALS_TO_LEARN)
    assert room.room == 8


def test_a_stated_limit_wins_and_a_restart_keeps_the_room_until_it_shows_otherwise() -> None:
    room = EngineRoom()
    refusing(room, 4, 2, REFUSALS_TO_LEARN)
    room.stated(16, "/get_server_info")
    assert (room.room, room.basis, room.why) == (16, "stated", "/get_server_info states 16")
    refusing(room, 10, 3, REFUSALS_TO_LEARN)  # a queue below a stated limit: KV-bound
    assert room.room == 16
    room.reported(Seen(17, 0, True))  # it ran more than it said: never below what it ran
    assert room.room == 17
    room.restarted("its engine restarted")  # kept until the new process says
    assert (room.room, room.basis, room.most, room.restarts) == (17, "stated", 0, 1)
    room.stated(None, "/get_server_info")  # it no longer says: unknown
    assert (room.room, room.basis) == (None, "unknown")
    refusing(room, 8, 2, REFUSALS_TO_LEARN)
    room.restarted("it turned healthy")
    assert (room.room, room.basis, room.provisional) == (8, "seen-full", True)
    refusing(room, 2, 5, REFUSALS_TO_LEARN)  # restarted with fewer sequences
    assert (room.room, room.provisional) == (2, False) and "since it restarted" in room.why
    room.restarted("its engine restarted")
    room.reported(Seen(3, 0, True))  # restarted with more: it ran past the room
    assert (room.room, room.basis) == (None, "unknown")
    refusing(room, 6, 1, REFUSALS_TO_LEARN)
    room.forgotten("its engine reports no load")
    assert (room.room, room.basis, room.most) == (None, "unknown", 0)


def reported(
    backend: Backend, running: int, waiting: int, kv: float | None = None, at: float = 0.0
) -> None:
    """A report asked for at `at`, one of ours (if any) unstarted since the one before."""
    asked = Asked(at, backend.inflight, True)
    backend.engine_reported(EngineLoad("vllm", running, waiting, kv, None), asked)


def full(backend: Backend, room: int, at: float = 0.0) -> None:
    """Reports of an engine running `room` with a queue it does not take in: full."""
    for _ in range(REFUSALS_TO_LEARN):
        reported(backend, room, 1, at=at)


def judge(backend: Backend, now: float = 0.0, ceiling: int | None = None) -> str | None:
    return saturation(backend, now, ceiling, 0.95, 1)


def test_an_engine_whose_room_is_unknown_takes_everything() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    assert judge(backend) is None  # no report: the engine decides
    for _ in range(50):
        backend.sent(0.0)
    reported(backend, 40, 10)  # a queue, but never seen refusing at its most
    assert judge(backend) is None and queued_ours(backend, 0.0) == 0


def test_full_means_one_of_ours_waits_in_the_engines_own_queue() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    full(backend, 4)
    reported(backend, 0, 0)
    for _ in range(4):
        backend.sent(0.0)
    assert judge(backend) is None  # four on an engine of four: the next waits there
    backend.sent(0.0)
    assert queued_ours(backend, 0.0) == 1 and judge(backend) == "full"
    backend.started(0.0)  # one of ours started: at most the fifth waits there
    assert judge(backend) == "full"
    backend.ended(0.0, started=True)  # a sequence freed: the fifth runs, room for a sixth
    assert queued_ours(backend, 0.0) == 0 and judge(backend) is None
    assert judge(backend, ceiling=4) == "ceiling"


def test_others_fill_the_queue_and_one_of_ours_still_waits_its_turn_there() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    full(backend, 4)
    reported(backend, 4, 30)  # others' requests: all it runs, and 30 waiting
    assert judge(backend) is None  # ours takes its place in the engine's queue
    backend.sent(0.0)
    assert queued_ours(backend, 0.0) == 1 and judge(backend) == "full"
    backend.started(0.0)  # it ran: the next of ours may wait there
    assert judge(backend) is None
    assert judge(backend, now=2.5) is None  # and once that report is stale, others count nil


def test_while_ours_are_held_none_waits_in_an_engine_that_runs_only_ours() -> None:
    """The fair queue, not the engine's arrival order, picks who takes a sequence that frees;
    one of ours waits there all the same every PROBE_EVERY_S (a probe of more room), and at
    an engine that others queue at."""
    backend = Backend("http://gpu-1:8000", healthy=True)
    full(backend, 4)
    reported(backend, 0, 0)
    for _ in range(5):
        backend.sent(0.0)  # the fifth past its room, waiting there: a probe of more room
    assert queue_allowance(backend, 0.0, 1, held=False) == 1
    assert queue_allowance(backend, 0.0, 1, held=True) == 0
    assert queue_allowance(backend, PROBE_EVERY_S, 1, held=True) == 1  # the next probe
    backend.ended(0.0, False)
    assert saturation(backend, 0.0, None, 0.95, 0) == "full"
    reported(backend, 4, 6)  # others' requests beside our four: it queues them
    assert queue_allowance(backend, 0.0, 1, held=True) == 1


def test_a_fresh_report_of_room_never_holds() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    full(backend, 4)
    for _ in range(6):
        backend.sent(0.0)
    assert judge(backend) == "full"
    reported(backend, 3, 0, at=1.0)  # asked after our last change: free and empty
    assert reports_room(backend, 1.0, 0.95) and judge(backend, 1.0) is None
    backend.sent(1.5)  # our change since: the report no longer says all
    assert not reports_room(backend, 1.5, 0.95)


def test_a_nearly_full_kv_cache_holds_only_while_it_queues_or_we_sent_since() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    for _ in range(3):
        backend.sent(0.0)
    reported(backend, 3, 0, kv=0.97)
    assert judge(backend) is None  # no queue, nothing sent since: it runs all it has
    backend.sent(0.1)
    assert judge(backend, 0.1) == "kv"  # sent since, into a nearly full cache
    reported(backend, 3, 1, kv=0.97, at=0.2)
    assert judge(backend, 0.2) == "kv"  # it queues
    backend.ended(0.3, started=True)
    assert judge(backend, 0.3) is None  # one of ours ended since: room again
    assert judge(backend, 2.3) is None  # and a stale report holds nothing


# --- the gate -----------------------------------------------------------------------------------


def pool_of(count: int, room: int) -> BackendPool:
    """Healthy backends whose engines have shown a room of `room` sequences, idle: each
    takes `room` of ours and one more, which waits in its engine's queue."""
    pool = BackendPool(
        tuple(f"http://gpu-{i}:8000" for i in range(count)),
        failures_to_open=3,
        cooldown=10.0,
        probe_path="/health",
    )
    now = trio.current_time()
    for backend in pool.backends:
        backend.healthy = True
        full(backend, room, at=now)  # seen refusing: its room is known
        reported(backend, 0, 0, at=now)
    return pool


class Routes:
    """The router's part: pick a backend (the first, or the preferred prefix holder's) and
    reserve it; give reservations back."""

    def __init__(self) -> None:
        self.holder: dict[str, str] = {}  # request text -> backend URL holding its prefix
        self.routed: list[tuple[str, str]] = []
        self.decisions: dict[str, Decision] = {}  # by request text

    def route(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        wanted = self.holder.get(request.text or "")
        backend = next((b for b in candidates if b.url == wanted), candidates[0])
        backend.sent(trio.current_time())
        self.routed.append((request.text or "", backend.url))
        decision = self.decisions[request.text or ""] = Decision(backend, "test")
        return decision

    def prefers(self, candidates: Sequence[Backend], request: RouteRequest) -> Backend | None:
        wanted = self.holder.get(request.text or "")
        return next((b for b in candidates if b.url == wanted), None)

    def give_back(self, decision: Decision) -> None:
        decision.backend.ended(trio.current_time(), decision.started)


def gate_for(pool: BackendPool, routes: Routes, timeout: float = 30.0) -> Gate:
    stats = AdmissionStats(lambda *_: None, lambda *_: None, lambda *_: None, trio.current_time)
    limits = GateLimits(None, 0.95, 1, max_held=8, max_per_tenant=8, timeout=timeout)
    return Gate(pool, routes.route, routes.give_back, limits, stats, prefers=routes.prefers)


def done(gate: Gate, decision: Decision) -> None:
    """Its answer ended: a sequence of its engine is free."""
    decision.backend.ended(trio.current_time(), decision.started)
    gate.opened([None])


class Entering:
    """Requests entering a gate, each a task of `nursery`; `texts`: those that passed, in
    order."""

    def __init__(self, gate: Gate, nursery: trio.Nursery) -> None:
        self.gate = gate
        self.nursery = nursery
        self.texts: list[str] = []
        self.times: list[float] = []

    def start(self, text: str, tenant: str) -> None:
        self.nursery.start_soon(self._enter, text, tenant)

    async def in_turn(self, *requests: tuple[str, str]) -> None:
        """(text, tenant) entering one after the other, each as far as it goes."""
        for text, tenant in requests:
            self.start(text, tenant)
            await trio.testing.wait_all_tasks_blocked()

    async def _enter(self, text: str, tenant: str) -> None:
        decision = await self.gate.enter(RouteRequest(text=text), (), Admission(tenant))
        assert decision is not None
        self.texts.append(text)
        self.times.append(trio.current_time())


async def fill(gate: Gate, count: int) -> list[Decision]:
    """`count` requests that pass at once."""
    decisions = []
    for i in range(count):
        decision = await gate.enter(RouteRequest(text=f"fill-{i}"), (), Admission("a"))
        assert decision is not None and gate.held == 0
        decisions.append(decision)
    return decisions


async def test_a_request_passes_while_an_engine_has_room_and_is_held_once_none_has() -> None:
    pool, routes = pool_of(1, room=2), Routes()
    gate = gate_for(pool, routes)
    first, second, third = await fill(gate, 3)  # the third waits in the engine's queue
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
        done(gate, first)  # the sequence freed is the third's, waiting at the engine
        await trio.testing.wait_all_tasks_blocked()
        assert results == []  # and while requests are held, none more waits there
        done(gate, second)  # a free sequence: the fairest held request, then the next
        await trio.testing.wait_all_tasks_blocked()
        done(gate, third)
        await trio.testing.wait_all_tasks_blocked()
        assert results == ["heavy-0", "light"]
        nursery.cancel_scope.cancel()


async def test_the_room_a_light_keys_request_leaves_waits_a_moment_for_its_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A closed-loop client is busy all along but idle at the instant its answer ends: the
    room its request left waits ANTICIPATE_S for its next, then goes to the others."""
    pool, routes = pool_of(1, room=1), Routes()
    gate = gate_for(pool, routes)

    def end(text: str, tenant: str) -> None:
        routes.decisions[text].backend.ended(trio.current_time(), False)
        gate.ended([None], tenant)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.run)
        requests = Entering(gate, nursery)
        await requests.in_turn(("light-1", "light"), *((f"heavy-{i}", "heavy") for i in range(3)))
        assert requests.texts == ["light-1", "heavy-0"]  # heavy-0 waits at the engine
        end("heavy-0", "heavy")  # it gave up at the engine: the light key's still runs
        end("light-1", "light")  # room, which waits for the light key's next...
        await trio.testing.wait_all_tasks_blocked()
        assert requests.texts[-1] == "heavy-0" and gate.held == 2
        await requests.in_turn(("light-2", "light"))  # ...which comes a moment later
        assert requests.texts[-1] == "light-2" and gate.held == 2
        await trio.sleep(2 * ANTICIPATE_S)  # the gate's watch finds the wait taken: nothing
        assert requests.texts[-1] == "light-2" and gate.held == 2
        end("light-2", "light")  # and this time none comes: the heavy key's, after the wait
        ended = trio.current_time()
        await trio.sleep(2 * ANTICIPATE_S)  # virtual time: the autojump clock's
        assert (requests.texts[-1], requests.times[-1]) == ("heavy-1", ended + ANTICIPATE_S)
        nursery.cancel_scope.cancel()


async def test_an_engines_report_of_room_ends_the_wait_for_a_keys_next_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, routes = pool_of(1, room=1), Routes()
    (gpu,) = pool.backends
    gate = gate_for(pool, routes)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.run)
        requests = Entering(gate, nursery)
        await requests.in_turn(("light-1", "light"), ("heavy-0", "heavy"), ("heavy-1", "heavy"))
        gpu.ended(trio.current_time(), False)  # heavy-0 gave up
        gpu.ended(trio.current_time(), False)  # light-1 ended: its room waits for light
        gate.ended([None], "light")
        await trio.sleep(ANTICIPATE_S / 4)
        assert requests.texts[-1] == "heavy-0"
        reported(gpu, 0, 0, at=trio.current_time())  # asked after: free, nothing waiting
        gate.opened()
        await trio.testing.wait_all_tasks_blocked()
        assert requests.texts[-1] == "heavy-1"  # at once, not at the end of the wait
        nursery.cancel_scope.cancel()


async def test_a_keys_next_request_in_the_same_instant_takes_its_room_every_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The gate's watch of kept room may wake after the key's next request took it (both
    runnable at once, in either order): it finds nothing to end, and goes on."""
    pool, routes = pool_of(1, room=1), Routes()
    gate = gate_for(pool, routes)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.run)
        requests = Entering(gate, nursery)
        await requests.in_turn(("light-0", "light"), ("heavy-0", "heavy"), ("heavy-1", "heavy"))
        routes.decisions["heavy-0"].backend.ended(trio.current_time(), False)  # it gave up
        for turn in range(1, 9):
            routes.decisions[f"light-{turn - 1}"].backend.ended(trio.current_time(), False)
            gate.ended([None], "light")
            requests.start(f"light-{turn}", "light")
            await trio.sleep(2 * ANTICIPATE_S)
            assert requests.texts[-1] == f"light-{turn}" and gate.held == 1
        nursery.cancel_scope.cancel()


async def test_a_request_that_starts_lets_the_next_wait_in_the_engines_queue() -> None:
    """Others fill an engine: one of ours waits in its queue at a time, and the next goes
    the moment that one starts (its first byte), not at the next report."""
    pool, routes = pool_of(1, room=2), Routes()
    (gpu,) = pool.backends
    reported(gpu, 2, 9, at=trio.current_time())  # others' requests: all it runs, 9 waiting
    gate = gate_for(pool, routes)
    (ours,) = await fill(gate, 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.enter, RouteRequest(text="next"), (), Admission("a"))
        await trio.testing.wait_all_tasks_blocked()
        assert gate.held == 1
        ours.started = True
        gpu.started(trio.current_time())
        gate.opened()
        await trio.testing.wait_all_tasks_blocked()
        assert gate.held == 0 and routes.routed[-1] == ("next", gpu.url)


async def test_a_held_request_goes_where_its_prefix_is_when_that_engine_has_room() -> None:
    pool, routes = pool_of(2, room=1), Routes()
    gpu_0, gpu_1 = pool.backends
    gate = gate_for(pool, routes)
    decisions = await fill(gate, 4)
    assert [d.backend for d in decisions] == [gpu_0, gpu_0, gpu_1, gpu_1]
    routes.holder["p1"] = gpu_1.url
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.enter, RouteRequest(text="p0"), (), Admission("a"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(gate.enter, RouteRequest(text="p1"), (), Admission("b"))
        await trio.testing.wait_all_tasks_blocked()
        done(gate, decisions[2])  # gpu-1's sequence goes to the one waiting at gpu-1
        done(gate, decisions[3])  # then it has room: p1, whose prefix it holds, goes first
        await trio.testing.wait_all_tasks_blocked()
        assert routes.routed[-1] == ("p1", gpu_1.url) and gate.held == 1
        nursery.cancel_scope.cancel()
    assert gpu_0.inflight == 2 and gpu_1.inflight == 1


async def test_a_held_request_is_refused_at_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, routes = pool_of(1, room=1), Routes()
    gate = gate_for(pool, routes, timeout=30.0)
    await fill(gate, 2)
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
    first, second = await fill(gate, 2)
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
            done(gate, first)
            done(gate, second)  # a free sequence: still in the queue, it is routed
            assert backend.inflight == 1
    assert backend.inflight == 0 and backend.unstarted == 0 and gate.held == 0


async def test_held_requests_learn_when_no_backend_of_their_pool_is_left() -> None:
    pool, routes = pool_of(1, room=1), Routes()
    (backend,) = pool.backends
    gate = gate_for(pool, routes)
    await fill(gate, 2)
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
    """An engine last read while other senders filled it holds this proxy's requests beyond
    the one it lets wait in that engine's queue; a held request is traffic all the same, so
    the load scraper idling on the old report reads the engine at once. Measured (bench
    streams: others' 200 streams gone, this proxy's 50 starting), requests held on such a
    report waited ~2 s for the next idle scrape."""
    pool = pool_of(1, room=4)
    (gpu,) = pool.backends
    reported(gpu, 4, 1, at=trio.current_time())  # others': all it runs, and one waiting
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
    await send()  # waits in the engine's queue
    nursery.start_soon(send)
    await trio.testing.wait_all_tasks_blocked()
    assert woken.is_set() and router.requests == 2
    assert router.gate.held == 1 and router.busy
    reported(gpu, 1, 0, at=trio.current_time())  # read at once: the others' requests are gone
    router.gate.opened()
    await trio.testing.wait_all_tasks_blocked()
    assert router.gate.held == 0 and gpu.inflight == 2
