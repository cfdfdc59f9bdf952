"""Loading LoRA adapters on demand: where, what to unload first, when to try again. Pure: the
caller passes the backends and `now`, does the HTTP calls (adapter_loader.py) and reports
how they went.

The rules:
- An adapter is ready when an engine that takes its traffic lists it; nothing is loaded.
- Otherwise one load is in flight per adapter (`Flight`): the first request starts it,
  every other request for it waits for its outcome. Concurrent first requests load it once.
- Where: an engine that serves the adapter's base model (any engine when its table names
  none) and takes traffic; among them, those with a free adapter slot first, then the least
  loaded, ties broken by rendezvous hashing on the adapter's name so replicas pick alike.
- An engine is full when it lists `capacity` adapters: its reported `max_lora`, or, once it
  refused a load while holding others, as many as it held then. When every engine of the
  base is full, the least recently used adapter of them all is unloaded first: one not in
  its engine's modelled slots (adapters.py) before those that are, the slots' oldest first.
  Only adapters of the table are unloaded (Sluice can load them back), never one whose own
  load is in flight.
- A failed attempt is tried again after `BACKOFF_S * 2**(attempt-1)` seconds, on another
  engine of the base if there is one, at most `MAX_ATTEMPTS` times in all; a refusal of an
  engine that held adapters is taken for "full": its capacity is learnt, and the retry on it
  unloads one first.
- A hot adapter is loaded on one more engine (`replicate`) when every engine that lists it
  is full (the gate holds requests back from it, or it queues them) while an engine of its
  base that does not list it has room and a free slot: one such load at a time per adapter,
  at most one every `REPLICATE_EVERY_S` (the new engine's share of the traffic shows before
  the next), one attempt, and never unloading another adapter for it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from app.fleet.backends import Backend
from app.models import AdapterConfig

MAX_ATTEMPTS = 3
BACKOFF_S = 0.2
REPLICATE_EVERY_S = 10.0


@dataclass(frozen=True)
class Placement:
    """Load the adapter on `backend`, unloading `evict` there first when it is given."""

    backend: Backend
    evict: str | None


@dataclass(eq=False)
class Flight:
    """The one load of an adapter under way: attempts so far, where they went, how it ended
    (`loaded_on`, or `error` once it gave up)."""

    adapter: str
    attempts: int = 0
    tried: list[Backend] = field(default_factory=list)
    loaded_on: Backend | None = None
    error: str | None = None
    replica_on: Backend | None = None  # a hot adapter's one more engine (`replicate`)

    @property
    def over(self) -> bool:
        return self.loaded_on is not None or self.error is not None


@dataclass(frozen=True)
class Retry:
    after_s: float
    placement: Placement


def rendezvous_order(adapter: str, backends: Sequence[Backend]) -> list[Backend]:
    """`backends` in the order rendezvous hashing on `adapter` gives, the same in every
    replica."""

    def score(backend: Backend) -> bytes:
        return hashlib.blake2b(f"{adapter}|{backend.id}".encode(), digest_size=8).digest()

    return sorted(backends, key=score)


def _last_used(backend: Backend, adapter: str) -> float:
    last = backend.adapters.last_used(adapter)
    return -math.inf if last is None else last


class AdapterLedger:
    def __init__(self, table: Sequence[AdapterConfig]) -> None:
        self.table: Mapping[str, AdapterConfig] = {a.name: a for a in table}
        self.flights: dict[str, Flight] = {}
        # Backend id -> adapters it held when it refused a load (its capacity, learnt).
        self.learnt_capacity: dict[str, int] = {}
        self.replicated_at: dict[str, float] = {}  # by adapter: its last replica's start

    def ready_on(self, adapter: str, backends: Sequence[Backend], now: float) -> list[Backend]:
        """The engines that take `adapter`'s traffic and list it."""
        return [b for b in backends if adapter in b.served and b.takes_traffic(now, adapter)]

    def hosts(self, adapter: str, backends: Sequence[Backend], now: float) -> list[Backend]:
        """The engines it may be loaded on: those of its base that take traffic."""
        base = self.table[adapter].base
        return [
            b
            for b in backends
            if b.role == "both" and (base is None or base in b.served) and b.takes_traffic(now)
        ]

    def capacity(self, backend: Backend) -> float:
        learnt = self.learnt_capacity.get(backend.id)
        stated = backend.adapters.max_lora
        known = [c for c in (learnt, stated) if c is not None]
        return min(known) if known else math.inf

    def begin(self, adapter: str) -> Flight | None:
        """A new flight for `adapter`, or None while one is under way (wait for it)."""
        flight = self.flights.get(adapter)
        if flight is not None and not flight.over:
            return None
        self.flights[adapter] = flight = Flight(adapter)
        return flight

    def replicate(
        self,
        adapter: str,
        listing: Sequence[Backend],
        backends: Sequence[Backend],
        now: float,
        has_room: Callable[[Backend], bool],
    ) -> Flight | None:
        """A flight loading `adapter` on one more engine, or None: while an engine that
        lists it (`listing`) has room, a load of it is under way, its last replica is
        younger than `REPLICATE_EVERY_S`, or no other engine of its base has room and a
        free slot."""
        if not listing or any(has_room(b) for b in listing):
            return None
        if now - self.replicated_at.get(adapter, -math.inf) < REPLICATE_EVERY_S:
            return None
        current = self.flights.get(adapter)
        if current is not None and not current.over:
            return None
        spare = [
            b
            for b in self.hosts(adapter, backends, now)
            if adapter not in b.served
            and len(b.adapters.parents) < self.capacity(b)
            and has_room(b)
        ]
        if not spare:
            return None
        self.replicated_at[adapter] = now
        target = min(rendezvous_order(adapter, spare), key=lambda b: b.load)
        self.flights[adapter] = flight = Flight(adapter, replica_on=target)
        return flight

    def place(self, flight: Flight, backends: Sequence[Backend], now: float) -> Placement | None:
        """Where its next attempt goes; None when no engine of its base takes traffic."""
        hosts = self.hosts(flight.adapter, backends, now)
        untried = [b for b in hosts if b not in flight.tried] or hosts
        if not untried:
            return None
        order = rendezvous_order(flight.adapter, untried)
        free = [b for b in order if len(b.adapters.parents) < self.capacity(b)]
        if free:
            return Placement(min(free, key=lambda b: b.load), None)
        victims = [(b, victim) for b in order if (victim := self.victim(b)) is not None]
        if victims:  # the coldest adapter of them all goes
            backend, victim = min(victims, key=lambda bv: _last_used(*bv))
            return Placement(backend, victim)
        return Placement(min(order, key=lambda b: b.load), None)  # let it say why not

    def victim(self, backend: Backend) -> str | None:
        """The adapter to unload from a full `backend`: its least recently used of the
        table, never one being loaded."""
        busy = {name for name, f in self.flights.items() if not f.over}
        evictable = [
            name for name in backend.adapters.parents if name in self.table and name not in busy
        ]
        if not evictable:
            return None
        resident = backend.adapters.resident
        cold = sorted(name for name in evictable if name not in resident)
        return cold[0] if cold else next(name for name in resident if name in evictable)

    def loaded(self, flight: Flight, backend: Backend) -> None:
        flight.loaded_on = backend
        base = self.table[flight.adapter].base or backend.primary or flight.adapter
        backend.served = backend.served | {flight.adapter}
        backend.adapters.parents[flight.adapter] = base

    def unloaded(self, backend: Backend, adapter: str) -> None:
        backend.served = backend.served - {adapter}
        backend.adapters.forget(adapter)

    def failed(
        self,
        flight: Flight,
        placement: Placement,
        error: str,
        backends: Sequence[Backend],
        now: float,
        *,
        refused: bool,
    ) -> Retry | None:
        """An attempt failed (`refused`: the engine answered no, rather than not at all):
        the next attempt, or None when the flight gives up (its `error` set)."""
        backend = placement.backend
        flight.attempts += 1
        flight.tried.append(backend)
        held = len(backend.adapters.parents)
        if refused and held and placement.evict is None:
            self.learnt_capacity[backend.id] = held
        if flight.attempts >= MAX_ATTEMPTS:
            flight.error = error
            return None
        following = self.place(flight, backends, now)
        if following is None:
            flight.error = error
            return None
        return Retry(BACKOFF_S * 2 ** (flight.attempts - 1), following)

    def gave_up(self, flight: Flight, error: str) -> None:
        flight.error = error
