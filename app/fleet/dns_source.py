"""A `--discover-dns` name as a discovery source: its records, looked up again and again,
are the engines (app/fleet/discoverer.py runs it; app/fleet/dns_schedule.py says when).

Design rules:
1. `NAME:PORT`: every A and AAAA record of NAME is an engine on PORT (a headless Service).
   `_service._proto.NAME`: every SRV record is an engine, its target's A/AAAA addresses on
   the record's port; priority and weight are not read (each engine takes traffic; the
   router balances them itself), a target of "." (no service) names none.
2. An answer is the whole truth: a healthy server saying the name does not exist (NXDOMAIN)
   or has no such records (NODATA) lists zero engines, and every engine leaves (drains): a
   headless Service scaled to 0 answers so. Anything else (a timeout, SERVFAIL, REFUSED, no
   server reachable, no resolv.conf) is a failed lookup: `report.failed`, what was seen
   last stands, and the schedule backs off. One failed query fails the whole lookup: half
   an answer (A without AAAA, some SRV targets) is never published as the whole set.
3. dnspython's asyncresolver does the asking, on Trio's own sockets (its trio backend): no
   thread, no getaddrinfo; a nameserver is an IP address, never a name to resolve first.
   Its cache stays off, so nothing outlives its TTL here; the system's resolv.conf (and its
   search list, as getaddrinfo would use it) unless `--dns-server` names the server.
"""

from __future__ import annotations

from collections.abc import Iterable

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.nameserver
import dns.rdata
import dns.rdatatype
import dns.resolver
import trio
from dns.rdtypes.IN.A import A
from dns.rdtypes.IN.AAAA import AAAA
from dns.rdtypes.IN.SRV import SRV

from app.discovery_targets import DnsServer, DnsTarget
from app.fleet.discoverer import SourceReport
from app.fleet.discovery import Endpoint
from app.fleet.dns_schedule import LookupSchedule, engine_url

# What a lookup found: the engines' URLs and the shortest TTL among its answers (None: none).
Found = tuple[set[str], float | None]
ADDRESS_TYPES = (dns.rdatatype.A, dns.rdatatype.AAAA)
LOOKUP_ERRORS = (dns.exception.DNSException, OSError)


class DnsSource:
    """One `--discover-dns` name, looked up on `LookupSchedule`'s schedule."""

    def __init__(self, target: DnsTarget, server: DnsServer | None, interval: float) -> None:
        self.name = target.source
        self.target = target
        self.server = server
        self.schedule = LookupSchedule(interval)
        self._resolver: dns.asyncresolver.Resolver | None = None

    async def run(self, report: SourceReport) -> None:
        while True:
            try:
                urls, ttl = await self.look()
            except LOOKUP_ERRORS as exc:
                report.failed(f"{type(exc).__name__}: {exc}")
                delay = self.schedule.after_failure()
            else:
                report.sighting(Endpoint(url) for url in sorted(urls))
                delay = self.schedule.after_answer(ttl)
            await trio.sleep(delay)

    async def look(self) -> Found:
        """The engines the name's records list now."""
        if self.target.port is None:
            return await self._services(self.target.name)
        return await self._addresses(self.target.name, self.target.port, search=True)

    async def _services(self, name: str) -> Found:
        records, ttl = await self._records(name, dns.rdatatype.SRV, search=True)
        urls: set[str] = set()
        ttls = [ttl]
        for record in records:
            if not isinstance(record, SRV) or record.target == dns.name.root:
                continue
            found, target_ttl = await self._addresses(
                record.target.to_text(), record.port, search=False
            )
            urls |= found
            ttls.append(target_ttl)
        return urls, shortest(ttls)

    async def _addresses(self, name: str, port: int, *, search: bool) -> Found:
        urls: set[str] = set()
        ttls = []
        for rdtype in ADDRESS_TYPES:
            records, ttl = await self._records(name, rdtype, search=search)
            urls.update(
                engine_url(record.address, port)
                for record in records
                if isinstance(record, A | AAAA)
            )
            ttls.append(ttl)
        return urls, shortest(ttls)

    async def _records(
        self, name: str, rdtype: dns.rdatatype.RdataType, *, search: bool
    ) -> tuple[list[dns.rdata.Rdata], float | None]:
        """The records of one query and their TTL; none (with the negative answer's TTL)
        when the server says there are none."""
        resolver = self._resolver or self._make_resolver()
        try:
            answer = await resolver.resolve(name, rdtype, search=search)
        except dns.resolver.NXDOMAIN as exc:
            return [], negative_ttl(exc.kwargs.get("responses", {}).values())
        except dns.resolver.NoAnswer as exc:
            response = exc.kwargs.get("response")
            return [], negative_ttl([response] if response is not None else [])
        # The shortest TTL along the chain: a CNAME's (an ExternalName Service's) counts too.
        return list(answer), answer.chaining_result.minimum_ttl

    def _make_resolver(self) -> dns.asyncresolver.Resolver:
        resolver = dns.asyncresolver.Resolver(configure=self.server is None)
        if self.server is not None:
            server = dns.nameserver.Do53Nameserver(self.server.host, self.server.port)
            resolver.nameservers = [server]
        resolver.lifetime = self.schedule.lookup_timeout
        self._resolver = resolver
        return resolver


def negative_ttl(responses: Iterable[dns.message.Message]) -> float | None:
    """How long a "no such records" answer holds (RFC 2308: the lesser of its SOA's TTL and
    the SOA's minimum); None when the server sent no SOA."""
    ttls = [
        min(rrset.ttl, record.minimum)
        for response in responses
        for rrset in response.authority
        if rrset.rdtype == dns.rdatatype.SOA
        for record in rrset
    ]
    return min(ttls, default=None)


def shortest(ttls: Iterable[float | None]) -> float | None:
    known = [ttl for ttl in ttls if ttl is not None]
    return min(known, default=None)
