"""Rendezvous (highest-random-weight) hashing with bounded load. Pure.

Every backend gets a score for a key, `blake2b(key, url)`; the key's backends in score order
are its preference list. Proxy replicas given the same backends compute the same list (no
per-process salt, unlike Python's `hash` of a str), and removing a backend moves only the keys
it was first for. Bounded load (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
Bounded Loads", 2018) walks the list past backends that are too busy, so one hot key spills
to its second choice instead of drowning its first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def score(key_digest: bytes, name: str) -> int:
    digest = hashlib.blake2b(name.encode() + b"\0" + key_digest, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preference(key: bytes, items: Sequence[T], name: Callable[[T], str]) -> list[T]:
    """`items` ordered by their score for `key`, best first (ties by name: deterministic)."""
    key_digest = hashlib.blake2b(key, digest_size=16).digest()  # a long key is hashed once
    return sorted(items, key=lambda item: (score(key_digest, name(item)), name(item)), reverse=True)


def first_fit(
    key: bytes, items: Sequence[T], name: Callable[[T], str], fits: Callable[[T], bool]
) -> tuple[T, bool]:
    """The key's first backend that `fits`, and whether it was the very first choice;
    the first choice when none fits (the caller has already filtered out what must not be
    used, so everything left is better than nothing)."""
    ordered = preference(key, items, name)
    for position, item in enumerate(ordered):
        if fits(item):
            return item, position == 0
    return ordered[0], True
