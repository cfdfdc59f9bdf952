"""The discovery sources `--discover-dns` and `--discover-k8s` name, built for the
discoverer (app/fleet/discoverer.py)."""

from __future__ import annotations

from app.config import Settings
from app.fleet.discoverer import Source


def discovery_sources(settings: Settings) -> list[Source]:
    """One source per `--discover-dns` name and one for `--discover-k8s`."""
    sources: list[Source] = []
    return sources
