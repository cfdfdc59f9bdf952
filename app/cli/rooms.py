"""The whole configuration cut into the rooms' slices, and the rooms' metrics made.

Only start-up (app/cli) reads `Settings`; every other room declares the few values it reads
as a small frozen dataclass of its own, and gets it from here (tests/test_house.py holds the
rule). A slice's field takes the `Settings` field of its name (`cut`): a new flag is added
to `Settings` and, under the same name, to the slice of the room that reads it.

Each room declares its metrics in a class of its own, on the registry it is given here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import trio
from prometheus_client import CollectorRegistry

from app.config import SGLANG_BOOTSTRAP_PORT, BackendRole, ServerSettings, Settings
from app.fleet.metrics import FleetMetrics
from app.observe.metrics import LoopMetrics
from app.observe.request_trace import TrafficRecorder
from app.preprocess.metrics import PreprocessMetrics
from app.preprocess.settings import PreprocessSettings
from app.proxy.metrics import PdMetrics
from app.proxy.settings import ProxySettings
from app.routing.disaggregation import DisaggregationSettings
from app.routing.metrics import DoorMetrics, RoutingMetrics
from app.routing.policies import RoutingParams
from app.routing.router import RouterSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Slice = TypeVar("Slice", bound="DataclassInstance")


def cut(room_type: type[Slice], settings: Settings, **given: object) -> Slice:
    """A room's slice: each field taken from the `Settings` field of the same name, unless
    `given` (a field the room names its own way, or builds from several)."""
    taken = {
        each.name: getattr(settings, each.name)
        for each in dataclasses.fields(room_type)
        if each.name not in given
    }
    return room_type(**taken, **given)


def preprocess_settings(settings: Settings) -> PreprocessSettings:
    return cut(PreprocessSettings, settings)


def router_settings(settings: Settings) -> RouterSettings:
    return cut(
        RouterSettings,
        settings,
        params=cut(RoutingParams, settings),
        budget_replicas=settings.workers,
        shared_budgets=settings.redis_url is not None,
    )


def proxy_settings(settings: Settings) -> ProxySettings:
    return cut(ProxySettings, settings)


def disaggregation_settings(settings: Settings) -> DisaggregationSettings:
    return cut(DisaggregationSettings, settings)


def backend_roles(settings: Settings) -> dict[str, BackendRole]:
    """URL -> role of every backend that has one; an SGLang prefill engine named without its
    bootstrap port has SGLang's default."""
    default_port = SGLANG_BOOTSTRAP_PORT if settings.pd_protocol == "sglang" else None
    return {
        role.url: dataclasses.replace(role, bootstrap_port=role.bootstrap_port or default_port)
        if role.role == "prefill"
        else role
        for role in settings.backend_roles
    }


def dashboard_server(settings: Settings) -> ServerSettings:
    """The dashboard's own socket; the proxy's is `settings` itself."""
    return ServerSettings(settings.dashboard_host, settings.dashboard_port, settings.backlog)


@dataclass(frozen=True)
class RoomMetrics:
    """Every room's metrics on one registry (what /metrics exposes; one per running proxy,
    so that proxies in one process never share counters), and the dashboard's request log,
    which is not exported."""

    registry: CollectorRegistry
    preprocess: PreprocessMetrics
    loop: LoopMetrics
    fleet: FleetMetrics
    doors: DoorMetrics
    routing: RoutingMetrics
    traffic: TrafficRecorder
    pd: PdMetrics

    @classmethod
    def create(cls, clock: Callable[[], float] = trio.current_time) -> RoomMetrics:
        """`clock`: the loop's, for what is counted by the second (admission's window)."""
        registry = CollectorRegistry()
        fleet = FleetMetrics(registry)
        return cls(
            registry,
            PreprocessMetrics(registry),
            LoopMetrics(registry),
            fleet,
            DoorMetrics(registry),
            RoutingMetrics(registry, fleet, clock),
            TrafficRecorder(),
            PdMetrics(registry),
        )
