"""The door of each model's pool: a request passes at once while an engine of the pool has
room, and is held, unrouted, while none has (late binding).

`enter` routes a request among the pool's backends that are not saturated (saturation.py:
the engines' own reports and rooms, and the proxy's own requests as they are), unless
requests of its priority band are held already: a newcomer never overtakes them. Otherwise
it is held in the pool's `FairQueue` (admission.py) until an engine has room, its deadline
passes (429 with Retry-After), or it is shed to make room for a lighter tenant. Room is
looked for whenever it may have appeared (`opened`): a request on a backend started or
ended, an engine reported, a backend came back; and, while anything is held, every `POLL_S`
(a backend that recovered, a report that freed room). Each request that leaves is routed
then, by the pool's policy, among the backends with room, preferring among the next few in
fair order one whose prefix the backend with room holds (`AFFINITY_WINDOW`).

A request that leaves is reserved on its backend before its task wakes; a task cancelled in
between (its client left) gives the reservation back, so nothing is reserved for nobody.

While requests are held, the time an engine they may go to reports room (a report asked
for after our last change on it: free sequences, an empty queue) is counted per backend
(`AdmissionStats.held_with_room`): saturation.py's rule 4 says it stays zero, and this is
the watch on that rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, field, replace

import trio

from app.fleet.backends import Backend
from app.fleet.pool import BackendPool
from app.fleet.saturation import queue_allowance, reports_room, saturation
from app.models import NO_MODEL
from app.observe.admission_stats import AdmissionStats
from app.observe.saturation_signal import ModelSignal, RoleShare
from app.routing.adapter_affinity import holders_to_wait_for
from app.routing.admission import Admission, FairQueue, Held
from app.routing.decision import Decision, RouteRequest
from app.routing.refusal import Overloaded, ShedReason

POLL_S = 0.5
# After a request of a key with nothing held ends while others' requests are held, the room
# it leaves waits this long for that key's next request before the others' take it: a client
# that sends as soon as its last answer came (a chat turn, an agent's loop) is busy all along,
# but idle at the instant of the release. Measured (bench fairness, part S: 16-token streams
# on an engine of 4 beside a 32-client key), without it the light key's next request found
# each sequence its last one freed taken by the heavy key's, waited for the next to free
# (TTFT p50 238 ms) and got 0.57x its rate alone.
ANTICIPATE_S = 0.01
# How many places of fair order a held request may be passed over for one that keeps its
# cache affinity on the backend with room.
AFFINITY_WINDOW = 4

Route = Callable[[Sequence[Backend], RouteRequest], Decision]
Prefers = Callable[[Sequence[Backend], RouteRequest], Backend | None]


@dataclass(eq=False)
class _Ticket:
    request: RouteRequest
    exclude: tuple[Backend, ...]
    left: trio.Event = field(default_factory=trio.Event)
    decision: Decision | None = None
    refusal: Overloaded | None = None
    taken: bool = False  # its task has its decision


@dataclass(frozen=True)
class GateLimits:
    ceiling: int | None  # --max-inflight-per-backend: our requests on one backend, at most
    max_kv_usage: float  # an engine this full takes no more
    max_queued: int  # --max-queued-per-backend: ours waiting in one engine's queue, at most
    max_held: int  # held requests of one pool, every tenant's
    max_per_tenant: int  # held requests of one tenant in one pool
    timeout: float  # --admission-timeout: the longest a request is held


@dataclass(eq=False)
class Gate:
    """`route` chooses and reserves a backend, `give_back` releases a reservation nobody
    took; `stats` hears of every request that comes and leaves; `prefers` names the backend
    holding a request's prefix; `refused(model, reason)` hears of each refusal."""

    pool: BackendPool
    route: Route
    give_back: Callable[[Decision], None]
    limits: GateLimits
    stats: AdmissionStats
    _: KW_ONLY
    prefers: Prefers | None = None
    refused: Callable[[str | None, str], None] | None = None
    # One per pool (model), made at its first held request: at most MAX_MODELS + 1.
    queues: dict[str | None, FairQueue] = field(init=False, default_factory=dict)
    _anything_held: trio.Event = field(init=False, default_factory=trio.Event)
    # Backends that report room while requests they may take are held: since when.
    _room_since: dict[Backend, float] = field(init=False, default_factory=dict)
    # By pool: the key whose next request the room its last one left waits for, until when.
    _anticipated: dict[str | None, tuple[str, float]] = field(init=False, default_factory=dict)
    _anticipating: trio.Event = field(init=False, default_factory=trio.Event)

    @property
    def held(self) -> int:
        return sum(len(queue) for queue in self.queues.values())

    def saturated(self, backend: Backend) -> str | None:
        limits = self.limits
        now = trio.current_time()
        held = any(self.queues.get(model) for model in (None, *backend.served))
        queued = queue_allowance(backend, now, limits.max_queued, held)
        return saturation(backend, now, limits.ceiling, limits.max_kv_usage, queued)

    def signals(self) -> list[ModelSignal]:
        """Each model's pool for an autoscaler (app/observe/saturation_signal.py): every
        model a backend serves, and any for which requests are held. Each backend is judged
        once, whatever the number of models it serves."""
        now = trio.current_time()
        judged = {b: (self.full(b, now), _room_for_signal(b, now)) for b in self.pool.backends}
        models: set[str | None] = {m for b in self.pool.backends for m in b.served}
        models.update(model for model, queue in self.queues.items() if queue)
        signals = []
        for model in sorted(models, key=lambda m: m or ""):
            available = self.pool.available(now, (), model)
            engines = [judged[b] for b in available]
            queue = self.queues.get(model)
            oldest = queue.oldest_arrival() if queue else None
            signals.append(
                ModelSignal(
                    model or NO_MODEL,
                    len(engines),
                    sum(full for full, _ in engines),
                    len(queue) if queue else 0,
                    sum(room for _, room in engines),
                    0.0 if oldest is None else now - oldest,
                    self._role_shares(model, available, judged) if self.pool.disaggregated else (),
                )
            )
        return signals

    def _role_shares(
        self,
        model: str | None,
        available: list[Backend],
        judged: dict[Backend, tuple[bool, int]],
    ) -> tuple[RoleShare, ...]:
        """Each role among the model's engines (taking traffic or not): those taking
        traffic, and how many of them are saturated."""
        members = (b for b in self.pool.backends if model is None or model in b.served)
        counts = {b.role: [0, 0] for b in members}
        for backend in available:
            count = counts[backend.role]
            count[0] += 1
            count[1] += judged[backend][0]
        return tuple(RoleShare(role, n, full) for role, (n, full) in sorted(counts.items()))

    def full(self, backend: Backend, now: float) -> bool:
        """Saturated for an autoscaler (and for spreading a hot LoRA adapter): the gate holds
        requests back from it, or its engine's current report shows its own queue (an engine
        whose room is unknown queues there)."""
        queueing = backend.report_current(now) and backend.reported_waiting > 0
        return queueing or self.saturated(backend) is not None

    def with_room(self, candidates: Iterable[Backend]) -> list[Backend]:
        return [b for b in candidates if self.saturated(b) is None]

    async def enter(
        self, request: RouteRequest, exclude: tuple[Backend, ...], admission: Admission
    ) -> Decision | None:
        """A reserved decision in `request.model`'s pool (every backend's for None); None
        when none of its backends takes traffic at all. `Overloaded` when held too long or
        shed."""
        model = request.model
        now = trio.current_time()
        candidates = self.pool.available(now, exclude, model)
        if request.only is not None:
            candidates = [b for b in candidates if b in request.only]
        if not candidates:
            return None
        if not exclude:  # a retry asked once already
            self.stats.arrived(model, admission.tenant, admission.weight)
        queue = self.queues.get(model)
        if queue is None or not queue.holds_ahead_of(admission.priority):
            open_ = self.with_room(candidates)
            holders = holders_to_wait_for(model, candidates, open_) if open_ else []
            if holders:  # its adapter's holders are full, and a swap elsewhere costs more
                request = replace(request, only=frozenset(holders))
                open_ = []
            if open_:
                decision = self.route(open_, request)
                self.stats.left(model, admission.tenant, admission.weight, 0.0)
                return decision
        return await self._hold(request, exclude, admission, candidates)

    async def _hold(
        self,
        request: RouteRequest,
        exclude: tuple[Backend, ...],
        admission: Admission,
        candidates: Sequence[Backend],
    ) -> Decision | None:
        model = request.model
        queue = self.queues.get(model)
        if queue is None:
            limits = self.limits
            queue = self.queues[model] = FairQueue(limits.max_held, limits.max_per_tenant)
        ticket = _Ticket(request, exclude)
        prefers = self.prefers(candidates, request) if self.prefers is not None else None
        arrived = trio.current_time()
        held = Held(
            admission.tenant,
            admission.weight,
            admission.priority,
            arrived,
            ticket,
            prefers.url if prefers is not None else None,
            None if request.only is None else frozenset(b.url for b in request.only),
        )
        shed = queue.push(held)
        if shed is held:
            full = queue.held_by(held.tenant) >= queue.max_per_tenant
            raise self._refusal(model, ShedReason.KEY_QUEUE_FULL if full else ShedReason.QUEUE_FULL)
        if shed is not None:
            self._refuse(model, shed, ShedReason.QUEUE_FULL)
        self._anything_held.set()
        # Room may be open to others while a request pinned to a full backend is held.
        self._release_from(model, queue)
        deadline = min(arrived + self.limits.timeout, admission.deadline)
        self._watch_room()
        try:
            with trio.move_on_at(deadline):
                await ticket.left.wait()
            ticket.taken = ticket.left.is_set()
        finally:
            if not ticket.left.is_set():
                queue.remove(held)
                self._watch_room()
            elif ticket.decision is not None and not ticket.taken:
                # Cancelled after it was routed: nobody will use the reservation.
                self.give_back(ticket.decision)
        if ticket.refusal is not None:
            raise ticket.refusal
        if not ticket.taken:
            raise self._refusal(model, ShedReason.QUEUE_TIMEOUT)
        return ticket.decision

    def ended(self, models: Sequence[str | None], tenant: str | None) -> None:
        """A request of `tenant` ended on a backend of these pools: room. Where others'
        requests are held and none of `tenant`'s, that room waits ANTICIPATE_S for its next
        request, which takes it; then it is anyone's, in fair order. An engine's report of
        room meanwhile ends the wait: nothing is held while one says it has room."""
        if tenant is not None:
            until = trio.current_time() + ANTICIPATE_S
            for model in models:
                queue = self.queues.get(model)
                if queue and not queue.held_by(tenant) and model not in self._anticipated:
                    self._anticipated[model] = (tenant, until)
                    self._anticipating.set()
        self.opened(models)

    def opened(self, models: Iterable[str | None] | None = None) -> None:
        """Room may have appeared in these pools (every pool for None): let held requests
        leave while it lasts."""
        for model in list(self.queues) if models is None else models:
            queue = self.queues.get(model)
            if queue:
                self._release_from(model, queue)
        # A clock starts only on a report (every pool opened) or a request held (`_hold`);
        # any change may stop one.
        if self._room_since or (models is None and self.held):
            self._watch_room()

    def _watch_room(self) -> None:
        """Start or stop the clock of each backend that reports room while a held request
        could go to it (none should: saturation.py, rule 4); `--max-inflight-per-backend`
        holding at its ceiling is the operator's choice, and not counted."""
        now = trio.current_time()
        max_kv = self.limits.max_kv_usage
        reporting: set[Backend] = set()
        for model, queue in self.queues.items():
            if not queue:
                continue
            for backend in self.pool.available(now, (), model):
                if (
                    backend not in reporting
                    and reports_room(backend, now, max_kv)
                    and self.saturated(backend) != "ceiling"
                    and queue.waiting_for(_may_go_to_one_of(frozenset((backend.url,))))
                ):
                    reporting.add(backend)
        for backend in [b for b in self._room_since if b not in reporting]:
            self.stats.held_with_room(backend.url, now - self._room_since.pop(backend))
        for backend in reporting:
            self._room_since.setdefault(backend, now)

    def _release_from(self, model: str | None, queue: FairQueue) -> None:
        now = trio.current_time()
        waited_for = None  # the key the room was kept for, whose request is here: first
        anticipated = self._anticipated.get(model)
        if anticipated is not None:
            tenant, until = anticipated
            if now < until and not queue.held_by(tenant) and not self._reports_room(model, now):
                return  # its room waits for that key's next request
            del self._anticipated[model]
            waited_for = tenant if queue.held_by(tenant) else None
        while queue:
            candidates = self.pool.available(now, (), model)
            if not candidates:
                # Nothing of this pool takes traffic: the held learn it now (503).
                while (held := queue.pop()) is not None:
                    self._wake(held, None)
                return
            open_ = self.with_room(candidates)
            if not open_:
                return
            urls = frozenset(backend.url for backend in open_)
            if waited_for is not None:
                prefer, window = _of_tenant(waited_for), len(queue)
                waited_for = None
            else:
                prefer, window = _prefers_one_of(urls), AFFINITY_WINDOW
            held = queue.pop(prefer, window, _may_go_to_one_of(urls))
            if held is None:
                return
            ticket = self._ticket(held)
            if held.only is not None:
                choices = [b for b in open_ if b.url in held.only]
            else:
                choices = [b for b in open_ if b not in ticket.exclude] or open_
            decision = self.route(choices, ticket.request)
            decision.waited = now - held.arrived
            self._wake(held, decision)
            self.stats.left(model, held.tenant, held.weight, decision.waited)

    def _reports_room(self, model: str | None, now: float) -> bool:
        """Whether an engine of the pool reports room since our last change on it: then
        nothing is held, not even for a key's next request (saturation.py, rule 4)."""
        max_kv = self.limits.max_kv_usage
        return any(reports_room(b, now, max_kv) for b in self.pool.available(now, (), model))

    def _wake(self, held: Held, decision: Decision | None) -> None:
        ticket = self._ticket(held)
        ticket.decision = decision
        ticket.left.set()

    def _refuse(self, model: str | None, held: Held, reason: ShedReason) -> None:
        ticket = self._ticket(held)
        ticket.refusal = self._refusal(model, reason)
        ticket.left.set()

    def _refusal(self, model: str | None, reason: ShedReason) -> Overloaded:
        self.stats.shed(model, reason)
        if self.refused is not None:
            self.refused(model, reason)
        if reason is ShedReason.QUEUE_TIMEOUT:
            message = (
                f"Every backend stayed saturated for the {self.limits.timeout:g}s this request "
                "could wait (or its own deadline); try again later."
            )
        else:
            whose = "this API key's" if reason is ShedReason.KEY_QUEUE_FULL else "the"
            message = f"Every backend is saturated and {whose} wait queue is full; try again."
        return Overloaded(reason, message, 1.0)

    @staticmethod
    def _ticket(held: Held) -> _Ticket:
        assert isinstance(held.ticket, _Ticket)
        return held.ticket

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """While anything is held, look for room every POLL_S; an idle proxy sleeps. Room
        kept for a key's next request goes to anyone's once its wait is over."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._end_anticipations)
            task_status.started()
            while True:
                if not self.held:
                    self._anything_held = trio.Event()
                    await self._anything_held.wait()
                await trio.sleep(POLL_S)
                self.opened()

    async def _end_anticipations(self) -> None:
        while True:
            if not self._anticipated:  # (a key's next request may have taken it meanwhile)
                self._anticipating = trio.Event()
                await self._anticipating.wait()
                continue
            await trio.sleep_until(min(until for _, until in self._anticipated.values()))
            now = trio.current_time()
            over = [model for model, (_, until) in self._anticipated.items() if until <= now]
            for model in over:
                del self._anticipated[model]
            self.opened(over)


def _room_for_signal(backend: Backend, now: float) -> int:
    """Its room; unknown, what it runs now (as last reported, else ours), at least 1."""
    if backend.room.room is not None:
        return backend.room.room
    running = backend.reported_running if backend.report_current(now) else backend.inflight
    return max(1, running)


def _prefers_one_of(urls: frozenset[str]) -> Callable[[Held], bool]:
    return lambda held: held.prefers in urls


def _of_tenant(tenant: str) -> Callable[[Held], bool]:
    return lambda held: held.tenant == tenant


def _may_go_to_one_of(urls: frozenset[str]) -> Callable[[Held], bool]:
    return lambda held: held.only is None or not held.only.isdisjoint(urls)
