"""The events of a gRPC server connection (grpc_connection.py's `receive_data`), apart
so that the protocol module stays short; grpc_connection re-exports them."""

from __future__ import annotations

import dataclasses
import enum

from app.epp.grpc_wire import Headers


# The events `receive_data` returns.
@dataclasses.dataclass(slots=True)
class CallStarted:
    stream_id: int
    path: str
    metadata: Headers
    timeout: float | None  # seconds, from grpc-timeout


@dataclasses.dataclass(slots=True)
class CallReadable:  # a message, or the end of the peer's messages, is there to read
    stream_id: int


@dataclasses.dataclass(slots=True)
class CallClosed:  # over before its handler finished (peer reset, bad framing answered here)
    stream_id: int


@dataclasses.dataclass(slots=True)
class WindowOpened:  # the peer widened a flow-control window: blocked senders may go on
    pass


@dataclasses.dataclass(slots=True)
class ConnectionEnded:  # no more frames either way: write `data_to_send()` (GOAWAY), close
    error: bool  # ours after the peer's protocol error, rather than the peer's GOAWAY


Event = CallStarted | CallReadable | CallClosed | WindowOpened | ConnectionEnded


class Wait(enum.Enum):
    """`next_message` has nothing yet. (Not b"": an empty protobuf message is b"".)"""

    WAIT = "wait"
