"""Whether requests are being sent: what the fleet's watchers (health checks, load scrapes)
pace themselves by, so that an idle proxy wakes for little. The router is the source."""

from __future__ import annotations

from typing import Protocol

import trio


class TrafficSource(Protocol):
    @property
    def reservations(self) -> int:
        """Requests sent to backends so far (it only ever grows)."""
        ...

    async def next_reservation(self) -> None:
        """Return when the next request is sent."""
        ...


class NoTraffic:
    """A fleet nobody sends to: a watcher used on its own."""

    reservations = 0

    async def next_reservation(self) -> None:
        await trio.sleep_forever()


NO_TRAFFIC = NoTraffic()
