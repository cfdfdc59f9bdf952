"""Which engines each discovery source sees, and what a new sighting changes. Pure.

Design rules:
1. A source publishes the whole set of engines it sees now (`Sighting`), never a delta: a
   lost update (a watch cut, a DNS answer dropped) is mended by the next whole set.
2. A source that cannot look (DNS timeout, API server gone) publishes nothing, and what it
   saw last stands: a failing lookup never empties the fleet. Only a successful answer that
   no longer lists an engine makes it leave.
3. A backend is in the pool while at least one source sees it (the same engine may be
   named by a DNS name and by `--backend`); static backends (flags, fleet file) and those
   added through the admin API are their own source and leave only by `DELETE`.
4. What a source says of an engine besides its address (role, models) is read when it
   joins; a later different word is a change of engine: it leaves and joins again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from app.config import Role

# How the pool names backends that no discovery source found.
STATIC_SOURCE = "static"
API_SOURCE = "api"


@dataclass(frozen=True)
class Endpoint:
    """An engine a source sees: its URL and what the source says of it."""

    url: str
    role: Role = "both"
    bootstrap_port: int | None = None
    models: tuple[str, ...] | None = None  # None: those its /v1/models lists


@dataclass(frozen=True)
class Changes:
    """What a sighting changes: engines to add (with the source that found them), URLs to
    drain."""

    joins: tuple[tuple[Endpoint, str], ...] = ()
    leaves: tuple[str, ...] = ()


@dataclass
class Membership:
    """Each source's last whole set, and the engine each URL stands for."""

    seen: dict[str, dict[str, Endpoint]] = field(default_factory=dict)  # source -> url -> it

    def sighted(self, source: str, endpoints: Iterable[Endpoint]) -> Changes:
        """`source` sees exactly `endpoints` now."""
        before = self._current()
        found = (replace(e, url=e.url.rstrip("/")) if e.url.endswith("/") else e for e in endpoints)
        self.seen[source] = {e.url: e for e in found}
        after = self._current()
        joins: list[tuple[Endpoint, str]] = []
        leaves: list[str] = []
        for url, (endpoint, owner) in after.items():
            earlier = before.get(url)
            if earlier is None:
                joins.append((endpoint, owner))
            elif earlier[0] != endpoint:
                leaves.append(url)
                joins.append((endpoint, owner))
        leaves.extend(url for url in before if url not in after)
        return Changes(tuple(joins), tuple(leaves))

    def forget(self, url: str) -> None:
        """The operator removed `url` (`DELETE /api/backends`): no source holds it any more,
        until one sees it again in a later sighting that adds it."""
        for found in self.seen.values():
            found.pop(url.rstrip("/"), None)

    def counts(self) -> dict[str, int]:
        """Engines each source sees now."""
        return {source: len(found) for source, found in self.seen.items()}

    def _current(self) -> dict[str, tuple[Endpoint, str]]:
        """URL -> the engine and the first source (in the order they first published)
        that sees it."""
        current: dict[str, tuple[Endpoint, str]] = {}
        for source, found in self.seen.items():
            for url, endpoint in found.items():
                current.setdefault(url, (endpoint, source))
        return current
