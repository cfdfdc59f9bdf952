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

One exception to "engines with room only": when every engine with room would have to push
another adapter out of its slots (the "none" tier) while an engine without room holds the
adapter, the request waits for that holder (the gate holds it). A swap costs more than the
wait: the adapter pushed out is swapped back in by its own next requests, elsewhere, and so
on; measured (`python -m load bench lora`), one such route became ~20 in 3 of 5 rounds, and
the requests that found their adapter in memory fell from 0.97 to 0.88-0.90.
"""

from __future__ import annotations

from collections.abc import Sequence

from app.fleet.adapters import TIER_ORDER, Tier
from app.fleet.backends import Backend


def is_adapter(model: str | None, candidates: Sequence[Backend]) -> bool:
    """Whether `model` is a LoRA adapter on some of these engines."""
    return model is not None and any(model in b.adapters.parents for b in candidates)


def holders_to_wait_for(
    model: str | None, candidates: Sequence[Backend], with_room: Sequence[Backend]
) -> list[Backend]:
    """For a request for an adapter that every engine with room (`with_room`) would have to
    swap in, pushing another out: the `candidates` without room that hold it, to wait for.
    Else (a base model, or an engine with room that suits it, or no holder) none."""
    if model is None or not is_adapter(model, candidates):
        return []
    if best_tier(with_room, model)[1] != "none":
        return []
    return [b for b in candidates if b.adapters.tier(model) == "resident"]


def best_tier(candidates: Sequence[Backend], adapter: str) -> tuple[list[Backend], Tier]:
    """The candidates of the best tier for `adapter`, and which tier that is."""
    tiers = [(b, b.adapters.tier(adapter)) for b in candidates]
    best = max((TIER_ORDER[tier] for _, tier in tiers), default=0)
    chosen = [b for b, tier in tiers if TIER_ORDER[tier] == best]
    return chosen, next((tier for _, tier in tiers if TIER_ORDER[tier] == best), "none")
