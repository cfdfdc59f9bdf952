"""A gate (app/routing/gate.py) on a real `BackendPool` whose engines' reports the tests set,
shared by the test_admission*.py files: reports of an engine running and queueing, an engine
seen full, a pool of engines of a known room, the router's part (`Routes`), and requests
entering a gate as tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
import trio.testing

from app.fleet.backends import Asked, Backend
from app.fleet.engine_metrics import EngineLoad
from app.fleet.pool import BackendPool
from app.fleet.room import REFUSALS_TO_LEARN
from app.observe.admission_stats import AdmissionStats
from app.routing.admission import Admission
from app.routing.decision import Decision, RouteRequest
from app.routing.gate import Gate, GateLimits


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
