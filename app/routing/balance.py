"""When is a backend too busy to keep its affinity? SMG's imbalance test, applied per backend. Pure.

SMG's `cache_aware` calls the fleet imbalanced when `max - min > balance_abs_threshold` and
`max > balance_rel_threshold * min`, and then drops cache affinity for every request. Sluice
asks the same question of one backend at a time (its load against the least-loaded one's):
only the backend that is too busy loses the request, and everyone else keeps affinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.fleet.backends import Backend
from app.routing.rendezvous import score


@dataclass(frozen=True)
class Balance:
    abs_threshold: float
    rel_threshold: float

    def overloaded(self, load: float, min_load: float) -> bool:
        return load - min_load > self.abs_threshold and load > self.rel_threshold * min_load


def least_loaded(
    candidates: Sequence[Backend], key_digest: bytes | None = None, turn: int = 0
) -> Backend:
    """The backend with the least load. Ties go by rendezvous score for `key_digest` (equal
    backends share new prefixes evenly and replicas agree), else in turns (`turn` counts up
    at the caller), so that idle backends share work that has no key."""
    if key_digest is not None:
        return min(candidates, key=lambda b: (b.load, -score(key_digest, b.id)))
    lowest = min(b.load for b in candidates)
    tied = [b for b in candidates if b.load == lowest]
    return tied[turn % len(tied)]
