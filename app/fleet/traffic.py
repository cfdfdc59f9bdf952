"""Whether requests are asking for backends: what the fleet's watchers (health checks, load
scrapes) pace themselves by, so that an idle proxy wakes for little. The router is the
source."""

from __future__ import annotations

from typing import Protocol

import trio


class TrafficSource(Protocol):
    @property
    def requests(self) -> int:
        """Requests that asked for a backend so far, sent or held (it only ever grows)."""
        ...

    @property
    def busy(self) -> bool:
        """Whether requests are in flight to backends or held for room now."""
        ...

    async def next_request(self) -> None:
        """Return when the next request asks for a backend."""
        ...


class NoTraffic:
    """A fleet nobody sends to: a watcher used on its own."""

    requests = 0
    busy = False

    async def next_request(self) -> None:
        await trio.sleep_forever()


NO_TRAFFIC = NoTraffic()
