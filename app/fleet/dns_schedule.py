"""When a `--discover-dns` name is looked up again, and what its records become. Pure.

Design rules:
1. After an answer, the next lookup is due after `--discover-interval`, sooner when the
   records' TTL is shorter: what was answered is never held past its TTL. A TTL of 0 (a
   server that says "do not cache", dnsmasq's default for its own records) means the
   interval, and a TTL is never followed sooner than `TTL_FLOOR_S`, so records of 0 or 1 s
   cannot make a lookup loop spin.
2. After a failed lookup (a timeout, SERVFAIL, REFUSED, no server reachable), the next try
   comes after `FIRST_RETRY_S`, doubling with each failure in a row, never later than the
   interval: a DNS server back from a restart is asked again soon, a dead one is not
   hammered. An answer ends the back-off.
3. A lookup never waits longer than the interval (nor less than `TTL_FLOOR_S`): a server
   that stopped answering is a failure the schedule above handles, not a stuck source.
4. An engine is `http://ADDRESS:PORT`; an IPv6 address is written in brackets (RFC 3986).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

# No lookup loop faster than this, whatever the TTL says.
TTL_FLOOR_S = 1.0
# The first retry after a failure; each failure in a row doubles it, up to the interval.
FIRST_RETRY_S = 0.25
# How long one lookup (every retry of every server together) may take, at most.
LOOKUP_TIMEOUT_S = 5.0


@dataclass
class LookupSchedule:
    """The delays between one name's lookups: `interval` between answers, TTL permitting."""

    interval: float
    failures: int = 0  # in a row

    def after_answer(self, ttl: float | None) -> float:
        """Seconds until the next lookup after an answer whose shortest TTL is `ttl` (None:
        the answer carried none, a negative answer without its zone's SOA)."""
        self.failures = 0
        if ttl is None or ttl <= 0:
            return self.interval
        return min(self.interval, max(ttl, TTL_FLOOR_S))

    def after_failure(self) -> float:
        """Seconds until the next try after a failed lookup."""
        self.failures += 1
        return min(self.interval, FIRST_RETRY_S * 2.0 ** min(self.failures - 1, 30))

    @property
    def lookup_timeout(self) -> float:
        """How long one lookup may take before it counts as failed."""
        return max(TTL_FLOOR_S, min(self.interval, LOOKUP_TIMEOUT_S))


def engine_url(address: str, port: int) -> str:
    """The engine at `address` (an IPv4 or IPv6 address, as DNS gives it) and `port`."""
    if ipaddress.ip_address(address).version == 6:
        return f"http://[{address}]:{port}"
    return f"http://{address}:{port}"
