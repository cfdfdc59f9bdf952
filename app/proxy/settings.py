"""What the proxy door reads of the configuration: start-up (app/cli/rooms.py) cuts it from
the whole `Settings`."""

from __future__ import annotations

from dataclasses import dataclass

from app.config import ForwardMode


@dataclass(frozen=True)
class ProxySettings:
    max_connections: int  # requests in flight; past it a fast 503
    max_body_bytes: int
    forward: ForwardMode  # passthrough: the JSON body; tokens: the prompt as token ids
    idle_timeout: float  # seconds allowed between two chunks of a streamed answer
