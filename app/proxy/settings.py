"""What the proxy door reads of the configuration: start-up (app/cli/rooms.py) cuts it from
the whole `Settings`."""

from __future__ import annotations

from dataclasses import dataclass

from app.config import ForwardMode


@dataclass(frozen=True)
class ProxySettings:
    max_connections: int  # requests in flight; past it a fast 503
    max_body_bytes: int
    forward: ForwardMode  # passthrough: the client's body; tokens: its prompt as token ids
    idle_timeout: float  # the longest silence of a backend's answer once it began
