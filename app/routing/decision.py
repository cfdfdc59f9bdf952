"""What a routing policy is given and what it answers. Pure.

The policies (policies.py, cache_aware.py, hashing.py) build on these types, the registry
(`make_policy`) on the policies, and the router and the proxy on both: no module imports back.
Every policy answers a `Decision`; its reason ends up in the `x-sluice-route` header and in
`sluice_route_decisions_total{policy,reason}`, so reasons are a small fixed vocabulary:
prefix-hit, spread, new-prefix, least-load, hash, session (cache_aware and consistent_hash),
rotation, random, tie, less_loaded, only_candidate (the simple policies), retry (set by the
proxy).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from app.fleet.backends import Backend
from app.routing.block_index import BLOCK_SIZE


@dataclass(slots=True)
class RouteRequest:
    """What a policy may look at. `token_ids` is None when tokenization was skipped; `text` is
    the rendered prompt or a prefix of it (opaque: only its start is hashed); `session` is the
    client's `x-session-id` header or the body's `user` field; `model` the served model whose
    pool the candidates are (None: a pool of every backend); `only` the backends it may go
    to (a follow-up of a response one backend stores; the gateway's subset hint), None for
    any; `block_hashes` the
    token ids' chained block hashes, when they were computed off the loop (a long prompt)."""

    token_ids: Sequence[int] | None = None
    text: str | None = None
    session: str | None = None
    model: str | None = None
    only: frozenset[Backend] | None = None
    block_hashes: Sequence[int] | None = None


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


@dataclass(slots=True)
class Decision:
    backend: Backend
    reason: str
    prediction: Prediction | None = None
    pending_tokens: int = 0  # prompt tokens left to prefill, reserved on the backend's load
    model: str | None = None  # the pool it was chosen in
    waited: float = 0.0  # seconds the request was held before an engine had room
    started: bool = False  # its answer's first byte came (`Router.started`)
    fallbacks: tuple[Backend, ...] = ()  # where it goes if the backend fails it, in order


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision: ...
