"""Routing policies: given the backends that take traffic, pick one and say why. Pure.

Every policy answers a `Decision`; the reason ends up in the `x-sluice-route` header and in
`sluice_route_decisions_total{policy,reason}`, so reasons are a small fixed vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from app.routing.backends import Backend


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at. `token_ids` is None when tokenization was skipped."""

    token_ids: Sequence[int] | None = None
    text: str | None = None


@dataclass(frozen=True)
class Decision:
    backend: Backend
    reason: str


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = 0

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        backend = candidates[self._counter % len(candidates)]
        self._counter += 1
        return Decision(backend, "rotation")


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


def make_policy(name: str, rng: random.Random | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    raise ValueError(f"unknown routing policy {name!r}")
