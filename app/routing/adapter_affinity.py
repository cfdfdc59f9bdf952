"""Adapter affinity: a request for a LoRA adapter goes to the engines best placed to run it.
Pure.

Before the policy chooses, the candidates (the adapter's pool, those with room) are cut to
the best tier of app/fleet/adapters.py's order: engines whose slots hold the adapter, else
those with a free slot, else those that queue it, else all. The policy (cache_aware's
prefix, the balance of load) then chooses within that tier. A tier, not a weighted score:
an engine that does not hold the adapter must swap one in (a load from host memory, and
another adapter's requests pushed out of the batch), a cost no prefix hit repays. Load
still counts, because only engines with room are candidates: a busy holder's requests
overflow to the next tier.

A request for a base model is not touched: it needs no slot.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.fleet.adapters import TIER_ORDER, Tier
from app.fleet.backends import Backend


def is_adapter(model: str | None, candidates: Sequence[Backend]) -> bool:
    """Whether `model` is a LoRA adapter on some of these engines."""
    return model is not None and any(model in b.adapters.parents for b in candidates)


def best_tier(candidates: Sequence[Backend], adapter: str) -> tuple[list[Backend], Tier]:
    """The candidates of the best tier for `adapter`, and which tier that is."""
    tiers = [(b, b.adapters.tier(adapter)) for b in candidates]
    best = max((TIER_ORDER[tier] for _, tier in tiers), default=0)
    chosen = [b for b, tier in tiers if TIER_ORDER[tier] == best]
    return chosen, next((tier for _, tier in tiers if TIER_ORDER[tier] == best), "none")
