"""Each model's saturation, the figure an autoscaler (KEDA, an HPA through prometheus-adapter)
scales the model's engines on, and its parts as gauges of their own. Pure: figures in,
figures out; `SaturationCollector` asks for them when scraped.

Design rules (app/README.md, *Admission*, says why these and not others):
1. `sluice_admission_saturation{model}` = the share of the model's engines that take traffic
   and are saturated (those the gate holds requests back from, or whose own queue is not
   empty) + the requests held for the model over its room (the sequences those engines run
   at once). 0 idle; 1 every engine full and nothing held; above 1 demand beyond the pool:
   1.5 is half a pool more than it has. A model with no engine taking traffic reads 1 plus
   its held requests: nothing serves it.
2. Read when scraped, from what the gate keeps anyway: nothing is counted per request.
3. With `--workers N` each worker reads its own, and the supervisor's merged exposition
   gives the combined figure once per model (`combine`): the largest of the workers'
   engines-saturated ratios (they judge the same engines, each exact about its own requests
   and behind on the others', so the largest is the least stale), the held requests summed
   (each worker holds its own), the largest room (the same engines). A mean would halve a
   saturation only one worker has seen yet; a sum would count each engine N times.
4. A disaggregated model (engines with prefill and decode roles) also gives each role's
   share of engines saturated, `sluice_admission_role_engines_saturated_ratio{model,role}`:
   the prefill and decode Deployments scale apart (a role with no engine taking traffic
   reads 1). Held requests count in the model's figure only: a held request waits for a
   way through the pool, not for one role.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from app.observe.metrics import ReadAtScrape

SATURATION = "sluice_admission_saturation"
ENGINES_SATURATED = "sluice_admission_engines_saturated_ratio"
ROOM = "sluice_admission_room"
OLDEST_HELD = "sluice_admission_oldest_held_seconds"
HELD = "sluice_admission_held"  # declared with the gate's other metrics (routing/metrics.py)
ROLE_ENGINES_SATURATED = "sluice_admission_role_engines_saturated_ratio"
MODEL_LABEL = "model"
ROLE_LABEL = "role"


@dataclass(frozen=True)
class RoleShare:
    """A disaggregated model's engines of one role (`prefill`, `decode`, or `both`)."""

    role: str
    engines: int  # of that role, taking traffic
    saturated: int

    @property
    def ratio(self) -> float:
        return self.saturated / self.engines if self.engines else 1.0


@dataclass(frozen=True)
class ModelSignal:
    """One model's pool as the gate sees it at a scrape."""

    model: str
    engines: int  # its backends that take traffic
    saturated: int  # of those, the ones whose engines are saturated
    held: int  # its requests held at the proxy
    room: int  # sequences its engines run at once (unknown: what each runs now, at least 1)
    oldest_held_s: float  # how long its longest-held request has waited (0: none held)
    roles: tuple[RoleShare, ...] = ()  # rule 4: a disaggregated model's, by role

    @property
    def engines_saturated_ratio(self) -> float:
        return self.saturated / self.engines if self.engines else 1.0

    @property
    def saturation(self) -> float:
        return saturation(self.engines_saturated_ratio, self.held, self.room)


def saturation(engines_saturated_ratio: float, held: float, room: float) -> float:
    """Rule 1's figure from its parts."""
    return engines_saturated_ratio + held / max(room, 1.0)


def combine(
    ratios: Iterable[tuple[str, float]],
    held: Iterable[tuple[str, float]],
    rooms: Iterable[tuple[str, float]],
) -> dict[str, float]:
    """Rule 3: by model, the saturation of several workers' (model, value) readings of the
    engines-saturated ratio, held requests and room."""
    ratio_of: dict[str, float] = {}
    for model, value in ratios:
        ratio_of[model] = max(value, ratio_of.get(model, 0.0))
    held_of: dict[str, float] = {}
    for model, value in held:
        held_of[model] = held_of.get(model, 0.0) + value
    room_of: dict[str, float] = {}
    for model, value in rooms:
        room_of[model] = max(value, room_of.get(model, 0.0))
    return {
        model: saturation(ratio, held_of.get(model, 0.0), room_of.get(model, 0.0))
        for model, ratio in ratio_of.items()
    }


def saturation_family(values: Iterable[tuple[str, float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        SATURATION,
        "What to scale a model's engines on: the share of its engines saturated plus its "
        "held requests over its room (1: every engine full; above 1, demand beyond the pool)",
        labels=[MODEL_LABEL],
    )
    for model, value in values:
        family.add_metric([model], value)
    return family


class SaturationCollector(ReadAtScrape):
    """Rule 1's figure and its parts, one reading of the gate a scrape. Nothing is read
    until `set_function` is given the reader."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._read: Callable[[], Iterable[ModelSignal]] = tuple
        registry.register(self)

    def set_function(self, read: Callable[[], Iterable[ModelSignal]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        signals = list(self._read())
        yield saturation_family((s.model, s.saturation) for s in signals)
        parts = (
            (
                ENGINES_SATURATED,
                "Share of a model's engines taking traffic that are saturated (the proxy "
                "holds requests back from them, or their own queue is not empty)",
                lambda s: s.engines_saturated_ratio,
            ),
            (
                ROOM,
                "Sequences a model's engines taking traffic run at once, as the proxy judges "
                "them (an engine whose room is unknown: what it runs now, at least 1)",
                lambda s: float(s.room),
            ),
            (
                OLDEST_HELD,
                "How long a model's longest-held request has waited at the proxy (0: none)",
                lambda s: s.oldest_held_s,
            ),
        )
        for name, documentation, value in parts:
            family = GaugeMetricFamily(name, documentation, labels=[MODEL_LABEL])
            for signal in signals:
                family.add_metric([signal.model], value(signal))
            yield family
        by_role = GaugeMetricFamily(
            ROLE_ENGINES_SATURATED,
            "Share of a disaggregated model's engines of one role (prefill, decode, both) "
            "taking traffic that are saturated: what each role's Deployment scales on",
            labels=[MODEL_LABEL, ROLE_LABEL],
        )
        for signal in signals:
            for share in signal.roles:
                by_role.add_metric([signal.model, share.role], share.ratio)
        yield by_role
