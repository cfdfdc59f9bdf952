"""The discovery sources `--discover-dns` and `--discover-k8s` name, built for the
discoverer (app/fleet/discoverer.py)."""

from __future__ import annotations

from app.config import Settings
from app.discovery_targets import DnsServer, DnsTarget, K8sTarget, LabelSelector
from app.fleet.discoverer import Source
from app.fleet.dns_source import DnsSource
from app.fleet.k8s_source import K8sSource, kube_client
from app.fleet.k8s_watch import PodRules


def discovery_sources(settings: Settings) -> list[Source]:
    """One source per `--discover-dns` name and one for `--discover-k8s`."""
    sources: list[Source] = []
    server = DnsServer.parse(settings.dns_server) if settings.dns_server else None
    for name in settings.discover_dns:
        sources.append(DnsSource(DnsTarget.parse(name), server, settings.discover_interval))
    if settings.discover_k8s is not None:
        target = K8sTarget.parse(settings.discover_k8s)
        sources.append(K8sSource(target, k8s_rules(settings), kube_client()))
    return sources


def k8s_rules(settings: Settings) -> PodRules:
    """How a discovered pod becomes an engine: its port and role."""
    prefill, decode = settings.discover_k8s_prefill, settings.discover_k8s_decode
    return PodRules(
        settings.discover_k8s_port,
        LabelSelector.parse(prefill) if prefill else None,
        LabelSelector.parse(decode) if decode else None,
    )
