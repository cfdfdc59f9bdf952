"""Routing without token ids: by a hash of the prompt's start or of the client's session. Pure.

When a request bailed out of tokenization (or token ids are not wanted), the start of its
rendered prompt is still a good prefix key: requests that share a system prompt share it.
`consistent_hash` keys on the session (`x-session-id` or the body's `user`) instead, so one
conversation stays on one backend. Both use rendezvous hashing with bounded load: replicas
given the same backends agree, and a backend that is too busy (`Balance`) is skipped for the
key's next choice rather than drowned.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from app.fleet.backends import Backend
from app.routing.balance import Balance, least_loaded
from app.routing.decision import Decision, RouteRequest
from app.routing.rendezvous import first_fit

# About 128 tokens of rendered prompt: the chat template's preamble and the start of the
# system prompt, which is what requests that can share a KV-cache prefix have in common.
HASH_PREFIX_CHARS = 512


def _backend_id(backend: Backend) -> str:
    return backend.id


def hash_route(
    candidates: Sequence[Backend], key: bytes, reason: str, balance: Balance
) -> Decision:
    min_load = min(b.load for b in candidates)
    backend, _ = first_fit(
        key, candidates, _backend_id, lambda b: not balance.overloaded(b.load, min_load)
    )
    return Decision(backend, reason)


def text_key(text: str) -> bytes:
    return text[:HASH_PREFIX_CHARS].encode("utf-8", "surrogatepass")


def route_without_tokens(
    candidates: Sequence[Backend], request: RouteRequest, balance: Balance, turn: int
) -> Decision:
    """By the prompt's start when there is one, else to the least-loaded backend."""
    if request.text:
        return hash_route(candidates, text_key(request.text), "hash", balance)
    return Decision(least_loaded(candidates, turn=turn), "least-load")


class ConsistentHash:
    name = "consistent_hash"

    def __init__(self, balance: Balance) -> None:
        self.balance = balance
        self._turn = 0

    def choose(self, candidates: Sequence[Backend], request: RouteRequest) -> Decision:
        if request.session:
            key = hashlib.blake2b(request.session.encode(), digest_size=16).digest()
            return hash_route(candidates, key, "session", self.balance)
        self._turn += 1
        return route_without_tokens(candidates, request, self.balance, self._turn)
