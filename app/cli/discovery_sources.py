"""The discovery sources `--discover-dns` and `--discover-k8s` name, built for the
discoverer (app/fleet/discoverer.py)."""

from __future__ import annotations

from app.config import Settings
from app.discovery_targets import DnsServer, DnsTarget
from app.fleet.discoverer import Source
from app.fleet.dns_source import DnsSource


def discovery_sources(settings: Settings) -> list[Source]:
    """One source per `--discover-dns` name and one for `--discover-k8s`."""
    sources: list[Source] = []
    server = DnsServer.parse(settings.dns_server) if settings.dns_server else None
    for name in settings.discover_dns:
        sources.append(DnsSource(DnsTarget.parse(name), server, settings.discover_interval))
    return sources
