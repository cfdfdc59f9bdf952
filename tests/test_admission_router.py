"""The running router in front of a gate (app/routing/router.py): a long prompt's blocks hashed
in a thread and recorded behind it (real time: a virtual clock would run the wait for the
thread out before it finishes), and a held request counted as traffic (the fleet's watchers
that pace themselves by it wake; on the autojump clock, so the engine's report stays fresh).
"""

from __future__ import annotations

from array import array

import trio
import trio.testing

from app.cli.rooms import RoomMetrics, router_settings
from app.config import Settings
from app.routing.cache_aware import CacheAware
from app.routing.decision import RouteRequest
from app.routing.router import Router
from tests.conftest import wait_until
from tests.gate_fakes import pool_of, reported


async def test_a_running_router_hashes_a_long_prompt_in_a_thread_and_records_it_behind(
    nursery: trio.Nursery,
) -> None:
    """Routing a 20,000-token prompt costs the loop no pass over its blocks: their hashes
    come from a thread, and the router's own task records them a slice at a time."""
    pool = pool_of(2, room=8)
    router = Router(router_settings(Settings()), pool, RoomMetrics.create().routing)
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
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """An engine last read while other senders filled it holds this proxy's requests beyond
    the one it lets wait in that engine's queue; a held request is traffic all the same, so
    the load scraper idling on the old report reads the engine at once. Measured (bench
    streams: others' 200 streams gone, this proxy's 50 starting), requests held on such a
    report waited ~2 s for the next idle scrape."""
    pool = pool_of(1, room=4)
    (gpu,) = pool.backends
    reported(gpu, 4, 1, at=trio.current_time())  # others': all it runs, and one waiting
    router = Router(router_settings(Settings()), pool, RoomMetrics.create().routing)
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
