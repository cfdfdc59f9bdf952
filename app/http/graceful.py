"""A listener's connections and their graceful end, for every server on Trio streams (the
HTTP server's, the endpoint picker's gRPC server's).

`close` stops accepting and asks each open connection to end; what a connection has in flight
goes on, and how it ends (HTTP: after the answer under way, gRPC: GOAWAY, its calls running
on) is the server's `end`. A connection that arrives while closing is asked at once. When the
last one has ended is each server's to tell (`wait_idle`): HTTP waits for answers, not idle
keep-alives; gRPC for its connections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import trio

Connection = TypeVar("Connection")


class Listening(Generic[Connection]):
    def __init__(self, end: Callable[[Connection], None]) -> None:
        self.closing = False
        self.connections: set[Connection] = set()
        self.accepting = trio.CancelScope()  # around the listeners' accept loop
        self._end = end

    def add(self, connection: Connection) -> None:
        self.connections.add(connection)
        if self.closing:
            self._end(connection)

    def discard(self, connection: Connection) -> None:
        self.connections.discard(connection)

    def close(self) -> None:
        self.closing = True
        self.accepting.cancel()
        for connection in self.connections:
            self._end(connection)
