"""Admission as the operator sees it: per model, how long held requests waited and how many
were shed; per API key, its share of what left the queue against its fair share. Feeds
Prometheus and the dashboard from the same counts. Pure: the caller passes `now` where the
window needs it.

A key's fair share of what left over the last `WINDOW_S` is max-min fair by weight over what
it asked for (`fair_shares`): a key asking less than its weight's share is owed all it asked,
and what it leaves goes to the others by weight. Bounded: at most `MAX_TENANTS` keys are kept per
window slot (the rest are counted as "other"), `MAX_WAITS` waits per model for percentiles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from app.models import NO_MODEL
from app.observe.saturation_signal import ModelSignal

WINDOW_S = 60
MAX_TENANTS = 256
MAX_WAITS = 1024
OTHER = "other"
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class KeyShare(TypedDict):
    """An API key's part of what left a model's queue over the window (counts, so that
    several workers' add up; the page divides by what left in all)."""

    weight: float
    asked: int
    left: int
    fair_left: float  # its max-min fair number of what left


class ModelSaturation(TypedDict):
    """What an autoscaler scales a model's engines on, and its parts
    (app/observe/saturation_signal.py); 0 for a model no backend serves any more."""

    saturation: float
    engines_saturated_ratio: float
    room: int
    oldest_held_s: float


class ModelAdmission(ModelSaturation):
    held: int
    wait_p50_s: float | None  # of its last held requests
    wait_p99_s: float | None
    shed: dict[str, int]  # by reason
    keys: dict[str, KeyShare]  # by key's label


class AdmissionSnapshot(TypedDict):
    """The `admission` block of the dashboard's snapshot."""

    window_s: int
    models: dict[str, ModelAdmission]


@dataclass
class _Second:
    at: int
    # (model, tenant) -> [requests that arrived at the gate, requests that left it]
    counts: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)


class AdmissionStats:
    def __init__(
        self,
        observe_wait: Callable[[str, float], None],
        count_left: Callable[[str, str], None],
        count_shed: Callable[[str, str], None],
        clock: Callable[[], float],
        count_held_with_room: Callable[[str, float], None] = lambda *_: None,
    ) -> None:
        """The callbacks move the Prometheus series (wait histogram, dispatches by model and
        key, sheds by model and reason, time held while a backend reported room); `clock`
        is the loop's."""
        self._observe_wait = observe_wait
        self._count_left = count_left
        self._count_shed = count_shed
        self._count_held_with_room = count_held_with_room
        self._clock = clock
        # By backend URL: seconds requests were held while its engine reported room (the
        # figure saturation.py's rule 4 keeps at zero); bounded by the pool (`forget`).
        self.held_with_room_s: dict[str, float] = {}
        self._seconds: deque[_Second] = deque(maxlen=WINDOW_S)
        self._waits: dict[str, deque[float]] = {}
        self._shed: dict[str, dict[str, int]] = {}

    def arrived(self, model: str | None, tenant: str, weight: float) -> None:
        """A request came to the gate: what its key asked for."""
        self._count(model or NO_MODEL, tenant, weight)[0] += 1

    def left(self, model: str | None, tenant: str, weight: float, waited: float) -> None:
        """A request passed the gate, after `waited` seconds held (0: at once)."""
        label = model or NO_MODEL
        self._count(label, tenant, weight)[1] += 1
        self._count_left(label, tenant)
        if waited > 0:
            self._waits.setdefault(label, deque(maxlen=MAX_WAITS)).append(waited)
            self._observe_wait(label, waited)

    def _count(self, model: str, tenant: str, weight: float) -> list[int]:
        at = int(self._clock())
        if not self._seconds or self._seconds[-1].at != at:
            self._seconds.append(_Second(at))
        second = self._seconds[-1]
        if (model, tenant) not in second.counts and len(second.counts) >= MAX_TENANTS:
            tenant = OTHER
        second.weights[tenant] = weight
        return second.counts.setdefault((model, tenant), [0, 0])

    def shed(self, model: str | None, reason: str) -> None:
        label = model or NO_MODEL
        by_reason = self._shed.setdefault(label, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self._count_shed(label, reason)

    def held_with_room(self, backend: str, seconds: float) -> None:
        """Requests were held for `seconds` while `backend`'s engine reported room."""
        self.held_with_room_s[backend] = self.held_with_room_s.get(backend, 0.0) + seconds
        self._count_held_with_room(backend, seconds)

    def forget(self, backend: str) -> None:
        self.held_with_room_s.pop(backend, None)

    def snapshot(
        self, held: Mapping[str, int], now: float, signals: Sequence[ModelSignal] = ()
    ) -> AdmissionSnapshot:
        """Per model: held now, its saturation (`signals`, the gate's reading), wait p50/p99
        of its last held requests, shed by reason; per key over the window: requests it sent,
        those that left, and its fair number of them."""
        signal_of = {signal.model: signal for signal in signals}
        asked: dict[str, dict[str, int]] = {}
        left: dict[str, dict[str, int]] = {}
        weights: dict[str, float] = {}
        for second in self._seconds:
            if second.at <= now - WINDOW_S:
                continue
            weights.update(second.weights)
            for (model, tenant), (arrived, passed) in second.counts.items():
                model_asked = asked.setdefault(model, {})
                model_asked[tenant] = model_asked.get(tenant, 0) + arrived
                model_left = left.setdefault(model, {})
                model_left[tenant] = model_left.get(tenant, 0) + passed
        models = sorted({*held, *left, *self._waits, *self._shed, *signal_of})
        idle = ModelSignal("", 0, 0, 0, 0, 0.0)
        return {
            "window_s": WINDOW_S,
            "models": {
                model: {
                    "held": held.get(model, 0),
                    **_saturation(signal_of.get(model, idle)),
                    "wait_p50_s": _percentile(self._waits.get(model, ()), 0.5),
                    "wait_p99_s": _percentile(self._waits.get(model, ()), 0.99),
                    "shed": dict(self._shed.get(model, {})),
                    "keys": _shares(asked.get(model, {}), left.get(model, {}), weights),
                }
                for model in models
            },
        }


def _saturation(signal: ModelSignal) -> ModelSaturation:
    if not signal.engines and not signal.held:  # no backend serves it any more
        return {"saturation": 0.0, "engines_saturated_ratio": 0.0, "room": 0, "oldest_held_s": 0.0}
    return {
        "saturation": signal.saturation,
        "engines_saturated_ratio": signal.engines_saturated_ratio,
        "room": signal.room,
        "oldest_held_s": signal.oldest_held_s,
    }


def _shares(
    asked: Mapping[str, int], left: Mapping[str, int], weights: Mapping[str, float]
) -> dict[str, KeyShare]:
    """By key: what it asked and got, and its fair number of what left."""
    fair = fair_shares(asked, weights, sum(left.values()))
    return {
        tenant: {
            "weight": weights.get(tenant, 1.0),
            "asked": asked.get(tenant, 0),
            "left": left.get(tenant, 0),
            "fair_left": round(fair.get(tenant, 0.0), 3),
        }
        for tenant in asked
    }


def fair_shares(
    demand: Mapping[str, float], weights: Mapping[str, float], total: float
) -> dict[str, float]:
    """Each tenant's fair share of `total` (max-min fair by weight): no tenant is owed more
    than it asked for (`demand`), and what one leaves goes to the others by their weights."""
    shares = dict.fromkeys(demand, 0.0)
    active = {tenant for tenant, wanted in demand.items() if wanted > 0}
    left = float(total)
    while active and left > 1e-9:
        weight = sum(weights.get(tenant, 1.0) for tenant in active)
        portion = {tenant: left * weights.get(tenant, 1.0) / weight for tenant in active}
        capped = {t for t in active if shares[t] + portion[t] >= demand[t]}
        if not capped:
            for tenant in active:
                shares[tenant] += portion[tenant]
            break
        for tenant in capped:
            left -= demand[tenant] - shares[tenant]
            shares[tenant] = float(demand[tenant])
        active -= capped
    return shares


def _percentile(values: Iterable[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
