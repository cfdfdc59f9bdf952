"""Routing policies: given the backends that take traffic, pick one and say why. Pure.

Every policy answers a `Decision`; the reason ends up in the `x-sluice-route` header and in
`sluice_route_decisions_total{policy,reason}`, so reasons are a small fixed vocabulary:
prefix-hit, spread, new-prefix, least-load, hash, session (cache_aware and consistent_hash),
rotation, random, tie, less_loaded, only_candidate (the simple policies), retry (set by the
proxy).
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from app.routing.backends import Backend
from app.routing.block_index import BLOCK_SIZE


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may look at. `token_ids` is None when tokenization was skipped; `text` is
    the rendered prompt or a prefix of it (opaque: only its start is hashed); `session` is the
    client's `x-session-id` header or the body's `user` field; `model` the served model whose
    pool the candidates are (None: a pool of every backend)."""

    token_ids: Sequence[int] | None = None
    text: str | None = None
    session: str | None = None
    model: str | None = None


@dataclass(frozen=True)
class Prediction:
    """What cache_aware believed the chosen backend held, to check against its answer."""

    prompt_tokens: int
    blocks: int  # leading blocks of the prompt the backend was believed to hold
    stamps: tuple[int, ...]  # their last-use stamps in the index before this request
    holder: Hashable = None  # whose entries in the index those are (None: the backend's id)

    @property
    def cached_tokens(self) -> int:
        # A backend always recomputes the prompt's last token, so at most this much can hit.
        return min(self.blocks, max(self.prompt_tokens - 1, 0) // BLOCK_SIZE) * BLOCK_SIZE

    @property
    def stores_blocks(self) -> bool:
        """Whether the backend will cache prompt blocks it did not hold, and so tell of
        them in its KV events (a prompt it held whole may be answered without a new block)."""
        return self.blocks < self.prompt_tokens // BLOCK_SIZE


@dataclass(frozen=True)
class Decision:
    backend: Backend
    reason: str
    prediction: Prediction | None = None
    pending_tokens: int = 0  # prompt tokens left to prefill, reserved on the backend's load
    model: str | None = None  # the pool it was chosen in


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision: ...


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
    # Imported here: those modules build on this one's types.
    from app.routing.balance import Balance
    from app.routing.cache_aware import CacheAware
    from app.routing.hashing import ConsistentHash

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
