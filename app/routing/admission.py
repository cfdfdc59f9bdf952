"""Requests held at the proxy while every engine of their pool is saturated, and the order in
which they leave. Pure: no Trio, no clock of its own (the caller passes times).

Design rules (app/README.md, *Admission*, says why 4 is drawn where it is):
1. Held requests are not bound to a backend: they wait in their model's `FairQueue`, and the
   router routes the one that leaves at the moment an engine has room (late binding), with
   the same policy as any other request.
2. Priority first: a request leaves before any held request of a higher band (a larger
   number, as vLLM's `priority`). Within a band, start-time fair queuing across tenants (API
   keys; requests without a key are one anonymous tenant): each request of a tenant of
   weight w takes 1/w of virtual time, and the request with the earliest virtual start
   leaves first. A tenant that was idle comes back at the present, with no credit saved up.
3. Affinity within a few places of fairness: `pop` may be asked to prefer a request (one
   whose prefix the engine with room holds) among the next `window` in fair order.
4. Bounded twice: `max_held` for all, and `max_per_tenant` for one while another tenant
   sends too (it came to this queue within the last CONTENDED_S); a tenant over its bound
   then is refused at once, and a full queue makes room by shedding the newest request of
   the tenant holding the most, unless that is the newcomer's own: one tenant's flood never
   fills the queue for everyone. A tenant alone may hold the whole queue: there is nobody to
   protect. Contention is "sent within CONTENDED_S", not "holds requests now": a light
   tenant's requests leave first and are seldom held.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from app.errors import require_at_least

ANONYMOUS = "anonymous"
# Another tenant that came to a queue this recently makes the per-tenant bound hold.
CONTENDED_S = 10.0


@dataclass(frozen=True)
class Admission:
    """Who a request is for admission: its tenant (the API key's label, or ANONYMOUS), the
    tenant's weight, its priority band (lower leaves first), and when it stops waiting."""

    tenant: str = ANONYMOUS
    weight: float = 1.0
    priority: int = 0
    deadline: float = math.inf


ANYONE = Admission()  # a request without a key, weight or deadline of its own


@dataclass(eq=False)
class Held:
    """One held request. `ticket` is the caller's: what to route, and whom to wake."""

    tenant: str
    weight: float
    priority: int
    arrived: float
    ticket: object = None
    prefers: str | None = None  # the backend holding its prefix when it was held, if any
    only: frozenset[str] | None = None  # the backends (URLs) it may go to; None: any
    start: float = field(default=0.0, init=False)  # virtual start, set when queued


@dataclass
class _Band:
    """One priority band: each tenant's requests in arrival order, and virtual time."""

    now: float = 0.0  # the virtual start of the last request to leave
    tenants: dict[str, deque[Held]] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)  # tenants' last virtual finish


class FairQueue:
    def __init__(self, max_held: int, max_per_tenant: int) -> None:
        require_at_least(0, max_held=max_held, max_per_tenant=max_per_tenant)
        self.max_held = max_held
        self.max_per_tenant = max_per_tenant
        self._bands: dict[int, _Band] = {}
        self._by_tenant: dict[str, int] = {}
        self._came_at: dict[str, float] = {}  # tenants' last request, those within CONTENDED_S
        self._held = 0

    def __len__(self) -> int:
        return self._held

    def held_by(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def holds_ahead_of(self, priority: int) -> bool:
        """Whether a request of this band would have to leave after one held already."""
        return any(band <= priority for band in self._bands)

    def push(self, held: Held) -> Held | None:
        """Queue `held`. Returns the request shed to make room for it (it may be `held`
        itself: then it was not queued)."""
        count = self.held_by(held.tenant)
        self._came(held.tenant, held.arrived)
        if count >= self.max_per_tenant and len(self._came_at) > 1:
            return held
        shed = None
        if self._held >= self.max_held:
            heaviest = max(self._by_tenant, key=self._by_tenant.__getitem__, default=None)
            if heaviest is None or self._by_tenant[heaviest] <= count + 1:
                return held
            shed = self._newest_of(heaviest)
            self.remove(shed)
        band = self._bands.get(held.priority)
        if band is None:
            band = self._bands[held.priority] = _Band()
        held.start = max(band.now, band.finish.get(held.tenant, band.now))
        band.finish[held.tenant] = held.start + 1.0 / held.weight
        band.tenants.setdefault(held.tenant, deque()).append(held)
        self._by_tenant[held.tenant] = count + 1
        self._held += 1
        return shed

    def _came(self, tenant: str, now: float) -> None:
        """Note that `tenant` sent a request at `now`, forgetting those quiet for longer than
        CONTENDED_S (what is kept is bounded by the tenants of the last CONTENDED_S)."""
        came_at = self._came_at
        came_at.pop(tenant, None)
        came_at[tenant] = now  # insertion order is the order of their last requests
        while now - came_at[oldest := next(iter(came_at))] > CONTENDED_S:
            del came_at[oldest]

    def pop(
        self,
        prefer: Callable[[Held], bool] | None = None,
        window: int = 1,
        eligible: Callable[[Held], bool] | None = None,
    ) -> Held | None:
        """The next request to leave: the first in fair order of the best band, or the first
        of its next `window` that `prefer` accepts; only a tenant's first request that is
        `eligible` (one pinned to a backend without room waits, and its tenant's behind it)."""
        heads = self._heads(eligible)
        if not heads:
            return None
        chosen = heads[0]
        if prefer is not None:
            chosen = next((h for h in heads[:window] if prefer(h)), chosen)
        band = self._bands[chosen.priority]
        band.now = max(band.now, chosen.start)
        self.remove(chosen)
        return chosen

    def oldest_arrival(self) -> float | None:
        """When the longest-held request came (None: none held). A tenant's requests are
        queued in arrival order, so only each tenant's first is looked at."""
        firsts = [q[0].arrived for band in self._bands.values() for q in band.tenants.values()]
        return min(firsts, default=None)

    def waiting_for(self, eligible: Callable[[Held], bool]) -> bool:
        """Whether `pop` would give a request that is `eligible`."""
        return bool(self._heads(eligible))

    def _heads(self, eligible: Callable[[Held], bool] | None) -> list[Held]:
        """The best band's tenants' first requests in fair order, those `eligible`."""
        if not self._bands:
            return []
        band = self._bands[min(self._bands)]
        heads = sorted((queue[0] for queue in band.tenants.values()), key=_order)
        return heads if eligible is None else [head for head in heads if eligible(head)]

    def remove(self, held: Held) -> None:
        """Take `held` out, wherever it is (it left, gave up, or was shed)."""
        band = self._bands.get(held.priority)
        queue = band.tenants.get(held.tenant) if band is not None else None
        if band is None or queue is None or held not in queue:
            return
        queue.remove(held)
        if not queue:
            del band.tenants[held.tenant]
            del band.finish[held.tenant]  # idle now: it comes back at the present
            if not band.tenants:
                del self._bands[held.priority]
        self._held -= 1
        left = self._by_tenant[held.tenant] - 1
        if left:
            self._by_tenant[held.tenant] = left
        else:
            del self._by_tenant[held.tenant]

    def _newest_of(self, tenant: str) -> Held:
        """The tenant's request shed first: the lowest band's (the largest number), newest."""
        for priority in sorted(self._bands, reverse=True):
            queue = self._bands[priority].tenants.get(tenant)
            if queue:
                return queue[-1]
        raise KeyError(tenant)


def _order(held: Held) -> tuple[float, float]:
    return held.start, held.arrived
