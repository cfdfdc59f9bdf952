"""Routing policies: given the backends that take traffic, pick one and say why. Pure.

The simple policies live here, cache_aware and consistent_hash in their own modules, and
`make_policy` builds any of them by name; what they all take and answer, and the reasons
they give, are in decision.py.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from app.fleet.backends import Backend
from app.routing.balance import Balance
from app.routing.cache_aware import CacheAware
from app.routing.decision import Decision, Policy, RouteRequest
from app.routing.hashing import ConsistentHash


class RoundRobin:
    """Each pool (model) in turn through its own backends."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counters: dict[str | None, int] = {}  # by model: at most MAX_MODELS + 1

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        turn = self._counters.get(request.model, 0)
        self._counters[request.model] = turn + 1
        return Decision(candidates[turn % len(candidates)], "rotation")


class RandomChoice:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        return Decision(self._rng.choice(candidates), "random")


class PowerOfTwo:
    """Sample two backends at random; take the one with fewer requests in flight."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], "only_candidate")
        first, second = self._rng.sample(list(candidates), 2)
        if first.inflight == second.inflight:
            return Decision(first, "tie")
        return Decision(min(first, second, key=lambda b: b.inflight), "less_loaded")


@dataclass(frozen=True)
class RoutingParams:
    """cache_aware's and consistent_hash's knobs (SMG's names; defaults in config.py)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: float = 16.0
    balance_rel_threshold: float = 1.5
    max_index_blocks: int = 262_144


def make_policy(
    name: str, rng: random.Random | None = None, params: RoutingParams | None = None
) -> Policy:
    params = params or RoutingParams()
    balance = Balance(params.balance_abs_threshold, params.balance_rel_threshold)
    if name == "cache_aware":
        return CacheAware(params.cache_threshold, balance, params.max_index_blocks)
    if name == "consistent_hash":
        return ConsistentHash(balance)
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    raise ValueError(f"unknown routing policy {name!r}")
