"""The gate that holds requests (app/routing/gate.py) on a real `BackendPool` whose engines'
reports the tests set, driven by tasks (trio.testing), on trio's autojump clock: a report's
freshness, the wait for a key's next request and a deadline are virtual time, the same on a
loaded machine.

Covers: a request passes at once while an engine has room and is held while none has; what
leaves when room appears is the fairest request, routed then (late binding), preferring one
whose prefix the engine with room holds; the room a light key's request leaves waits a moment
for its next (ended early by an engine's report of room); a request that starts lets the next
wait in the engine's queue; a deadline answers 429 at exactly its time; a request cancelled
while held leaves nothing behind, and one cancelled after it was routed gives its reservation
back; held requests learn when no backend is left. The fair queue is in
test_admission_fair_queue.py, the room and the judge in test_admission_room.py, the running
router in test_admission_router.py.
"""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from app.routing.admission import Admission
from app.routing.decision import Decision, RouteRequest
from app.routing.gate import ANTICIPATE_S
from app.routing.refusal import Overloaded
from tests.gate_fakes import Entering, Routes, done, fill, gate_for, pool_of, reported


async def test_a_request_passes_while_an_engine_has_room_and_is_held_once_none_has(
    autojump_clock: trio.testing.MockClock,
) -> None:
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


async def test_a_request_that_starts_lets_the_next_wait_in_the_engines_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
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


async def test_a_held_request_goes_where_its_prefix_is_when_that_engine_has_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
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


async def test_cancelled_requests_leave_nothing_held_and_nothing_reserved(
    autojump_clock: trio.testing.MockClock,
) -> None:
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


async def test_held_requests_learn_when_no_backend_of_their_pool_is_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
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
