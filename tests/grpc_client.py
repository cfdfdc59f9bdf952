"""A gRPC client's HTTP/2 side written with h2 (`Client`), the peer of the endpoint-picker door:
of `GrpcConnection` alone in test_epp_grpc_connection.py, of the Trio server over memory
streams in test_epp_grpc_server.py. `exchange` carries bytes both ways between a client and a
connection until neither has any.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    DataReceived,
    Event,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.settings import SettingCodes

from app.epp.grpc_connection import GrpcConnection, WindowOpened
from app.epp.grpc_wire import Limits, MessageReader, frame_message

ECHO = "/test.Echo/Chat"


@dataclass
class Response:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    ended: bool = False
    reset: ErrorCodes | int | None = None

    @property
    def status(self) -> int | None:
        """grpc-status, from the trailers or a Trailers-Only answer's headers."""
        value = self.trailers.get(b"grpc-status", self.headers.get(b"grpc-status"))
        return None if value is None else int(value)

    @property
    def message(self) -> bytes:
        return self.trailers.get(b"grpc-message", self.headers.get(b"grpc-message", b""))

    def messages(self) -> list[bytes]:
        return MessageReader(1 << 30).feed(bytes(self.data))


class Client:
    """A gRPC client's HTTP/2 side, by h2: `start` calls, `send` messages, `receive` what
    the server wrote. Received DATA is acknowledged at once unless `hold_acks`."""

    def __init__(self, settings: dict[SettingCodes | int, int] | None = None) -> None:
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        if settings:
            self.h2.local_settings.update(settings)
            self.h2.local_settings.acknowledge()
        self.h2.initiate_connection()
        self.responses: dict[int, Response] = {}
        self.events: list[Event] = []
        self.hold_acks = False

    def start(
        self,
        path: str = ECHO,
        *,
        end: bool = False,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, headers or grpc_headers(path), end_stream=end)
        self.responses[stream_id] = Response()
        return stream_id

    def send(self, stream_id: int, message: bytes, *, end: bool = False) -> None:
        self.send_raw(stream_id, frame_message(message), end=end)

    def send_raw(self, stream_id: int, data: bytes, *, end: bool = False) -> None:
        self.h2.send_data(stream_id, data, end_stream=end)

    def end(self, stream_id: int) -> None:
        self.h2.end_stream(stream_id)

    def reset(self, stream_id: int) -> None:
        self.h2.reset_stream(stream_id, ErrorCodes.CANCEL)

    def data_to_send(self) -> bytes:
        return self.h2.data_to_send()

    def receive(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            self.events.append(event)
            stream_id = getattr(event, "stream_id", None)
            response = self.responses.get(stream_id) if stream_id else None
            if isinstance(event, ResponseReceived) and response is not None:
                response.headers = dict(event.headers or ())  # type: ignore[arg-type]
            elif isinstance(event, TrailersReceived) and response is not None:
                response.trailers = dict(event.headers or ())  # type: ignore[arg-type]
            elif isinstance(event, DataReceived) and response is not None:
                response.data += event.data or b""
                if not self.hold_acks and stream_id is not None:
                    self.acknowledge(stream_id, event.flow_controlled_length or 0)
            elif isinstance(event, StreamEnded) and response is not None:
                response.ended = True
            elif isinstance(event, StreamReset) and response is not None:
                response.reset = event.error_code

    def acknowledge(self, stream_id: int, size: int) -> None:
        self.h2.acknowledge_received_data(size, stream_id)


def grpc_headers(path: str = ECHO, **extra: str) -> list[tuple[bytes, bytes]]:
    headers = {
        ":method": "POST",
        ":scheme": "http",
        ":authority": "epp",
        ":path": path,
        "content-type": "application/grpc",
        "te": "trailers",
        **{name.replace("_", "-"): value for name, value in extra.items()},
    }
    return [(name.encode(), value.encode()) for name, value in headers.items()]


def exchange(client: Client, server: GrpcConnection, *, byte_by_byte: bool = False) -> list:
    """Carry bytes both ways until neither side has any: the server's events, in order."""
    events: list = []
    while True:
        out, back = client.data_to_send(), b""
        if out:
            pieces = [out[i : i + 1] for i in range(len(out))] if byte_by_byte else [out]
            for piece in pieces:
                events += server.receive_data(piece)
        back = server.data_to_send()
        if back:
            client.receive(back)
        if not out and not back:
            return events


def connected(limits: Limits | None = None) -> tuple[Client, GrpcConnection]:
    client, server = Client(), GrpcConnection({ECHO}, limits or Limits())
    assert exchange(client, server) == [WindowOpened()]  # the client's SETTINGS
    return client, server
