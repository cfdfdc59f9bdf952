"""One HTTP/2 connection of the gRPC server, without I/O: bytes in, call events out.

http2.py keeps the HTTP/2 state (frames, HPACK, stream states, flow-control windows); this
class turns its events into gRPC calls, the way h11 turns bytes into HTTP events: the
caller feeds what the socket read (`receive_data`), acts on the events, and writes
`data_to_send()`. grpc_server.py is that caller, on Trio streams; tests drive this alone.

What it decides, and why:
- a request that is not a call we serve is answered here, never reaching a handler:
  unknown path -> UNIMPLEMENTED, not POST -> HTTP 405, not application/grpc -> HTTP 415,
  compressed or malformed framing -> INTERNAL/UNIMPLEMENTED, a message over the cap ->
  RESOURCE_EXHAUSTED; a stream error ends that call, an HTTP/2 protocol error the connection
  (GOAWAY), nothing more;
- memory stays bounded. Received bytes are acknowledged (WINDOW_UPDATE) as they come, a
  `Limits.ack_batch` at a time, while the call's unread messages stay under
  `max_unread_bytes`; past that we hold the acknowledgement until the handler reads, so a
  slow handler stops its peer instead of growing a queue. A call holds at most one partial
  message (<= `max_message_bytes`), `max_unread_bytes` of unread ones, and what the peer
  sent unacknowledged (<= the windows we granted); a connection at most
  `max_concurrent_streams` calls, which we advertise.
- sending respects the peer's windows: `send_some` queues what fits and says how much.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from typing import Literal

from app.epp.grpc_events import (
    CallClosed,
    CallReadable,
    CallStarted,
    ConnectionEnded,
    Event,
    Wait,
    WindowOpened,
)
from app.epp.grpc_wire import (
    DEFAULT_LIMITS,
    RESPONSE_HEADERS,
    GrpcError,
    Limits,
    MessageReader,
    StatusCode,
    read_call_head,
    trailers,
    trailers_only,
)
from app.epp.http2 import (
    ConnectionTerminated,
    DataReceived,
    LocalSettings,
    RequestReceived,
    ServerConnection,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from app.epp.http2_frames import ErrorCode, encode_headers

# Response headers are the same for every call: encoded once (http2_frames.py never indexes).
_RESPONSE_HEADERS = encode_headers(RESPONSE_HEADERS)
_OK_TRAILERS = encode_headers(trailers(StatusCode.OK))


class _Call:
    __slots__ = ("half_closed", "headers_sent", "inbox", "reader", "unacked", "unread")

    def __init__(self, max_message_bytes: int) -> None:
        self.reader = MessageReader(max_message_bytes)
        self.inbox: deque[bytes] = deque()
        self.unread = 0  # bytes of the messages in `inbox`
        self.unacked = 0  # flow-controlled bytes received and not yet acknowledged
        self.half_closed = False
        self.headers_sent = False


class GrpcConnection:
    def __init__(self, paths: Container[str], limits: Limits = DEFAULT_LIMITS) -> None:
        self.paths = paths
        self.limits = limits
        self.ended = False
        self._calls: dict[int, _Call] = {}
        self._h2 = ServerConnection(
            LocalSettings(
                max_concurrent_streams=limits.max_concurrent_streams,
                stream_window=limits.stream_window,
                connection_window=limits.connection_window,
                max_header_list_bytes=limits.max_header_list_bytes,
            )
        )

    def data_to_send(self) -> bytes:
        return self._h2.data_to_send()

    def receive_data(self, data: bytes) -> list[Event]:
        """What the peer's bytes mean, in order. Frames the protocol answers by itself
        (SETTINGS, PING) queue their answers in `data_to_send()`."""
        if self.ended:
            return []
        h2_events = self._h2.receive_data(data)
        events: list[Event] = []
        window_opened = False
        for event in h2_events:
            if isinstance(event, DataReceived):
                self._receive_message_bytes(event, events)
            elif isinstance(event, RequestReceived):
                self._start(event, events)
            elif isinstance(event, StreamEnded):
                self._half_close(event.stream_id, events)
            elif isinstance(event, StreamReset):
                if self._forget(event.stream_id) is not None:
                    events.append(CallClosed(event.stream_id))
            elif isinstance(event, WindowUpdated):
                window_opened = True
            elif isinstance(event, ConnectionTerminated):
                # Nothing is sent after a GOAWAY, not even on open streams.
                self.ended = True
                events.append(ConnectionEnded(error=event.error))
                return events
        if window_opened:
            events.append(WindowOpened())
        return events

    def _start(self, event: RequestReceived, events: list[Event]) -> None:
        stream_id, headers = event.stream_id, event.headers
        try:
            head = read_call_head(headers)
            if head.path not in self.paths:
                raise GrpcError(StatusCode.UNIMPLEMENTED, f"unknown method {head.path}")
        except GrpcError as error:
            if self._still_open(stream_id):
                answer = trailers_only(error.code, error.message, error.http_status)
                self._h2.send_headers(stream_id, encode_headers(answer), end_stream=True)
                self._stop_request(stream_id)
            return
        # A request that ends here also comes as StreamEnded, which half-closes the call.
        self._calls[stream_id] = _Call(self.limits.max_message_bytes)
        events.append(CallStarted(stream_id, head.path, headers, head.timeout))

    def _receive_message_bytes(self, event: DataReceived, events: list[Event]) -> None:
        stream_id, size = event.stream_id, event.flow_controlled_length
        call = self._calls.get(stream_id)
        if call is None:
            # A call we already ended: its bytes still count against the connection window.
            self._h2.acknowledge(size, stream_id)
            return
        try:
            messages = call.reader.feed(event.data)
        except GrpcError as error:
            self._h2.acknowledge(size, stream_id)
            self._end(stream_id, call, error.code, error.message)
            events.append(CallClosed(stream_id))
            return
        call.unacked += size
        if messages:
            call.inbox.extend(messages)
            call.unread += sum(map(len, messages))
            events.append(CallReadable(stream_id))
        if call.unread <= self.limits.max_unread_bytes:
            self._acknowledge(stream_id, call)

    def _acknowledge(self, stream_id: int, call: _Call) -> None:
        if call.unacked >= self.limits.ack_batch:
            self._h2.acknowledge(call.unacked, stream_id)
            call.unacked = 0

    def _half_close(self, stream_id: int, events: list[Event]) -> None:
        call = self._calls.get(stream_id)
        if call is None:
            return
        try:
            call.reader.finish()
        except GrpcError as error:
            self._end(stream_id, call, error.code, error.message)
            events.append(CallClosed(stream_id))
            return
        call.half_closed = True
        events.append(CallReadable(stream_id))

    def next_message(self, stream_id: int) -> bytes | Literal[Wait.WAIT] | None:
        """The call's next request message; None once the peer has half-closed and every
        message was read (or the call is over); Wait.WAIT when there is nothing yet."""
        call = self._calls.get(stream_id)
        if call is None:
            return None
        if call.inbox:
            message = call.inbox.popleft()
            call.unread -= len(message)
            if call.unacked and call.unread <= self.limits.max_unread_bytes:
                self._acknowledge(stream_id, call)
            return message
        return None if call.half_closed else Wait.WAIT

    def is_open(self, stream_id: int) -> bool:
        return stream_id in self._calls

    def send_some(self, stream_id: int, data: bytes | memoryview) -> int:
        """Queue as much of `data` (framed messages) as the windows allow; how much. Sends
        the response headers first if it has not yet. 0 when the call is closed."""
        call = self._calls.get(stream_id)
        if call is None or self.ended:
            return 0
        self.start_answer(stream_id)
        return self._h2.send_data(stream_id, data)

    def go_away(self) -> None:
        """The server is stopping: the calls begun are served, no new one."""
        self._h2.go_away()

    def start_answer(self, stream_id: int) -> None:
        """Queue the response headers now, to go out with the next bytes written (encoding
        them costs more than the message they come before)."""
        call = self._calls.get(stream_id)
        if call is not None and not call.headers_sent and not self.ended:
            self._h2.send_headers(stream_id, _RESPONSE_HEADERS)
            call.headers_sent = True

    def end_call(self, stream_id: int, code: StatusCode, message: str = "") -> None:
        """The handler is done: the status goes out (nothing if the call is already over)."""
        call = self._forget(stream_id)
        if call is not None and not self.ended:
            self._end(stream_id, call, code, message)

    def _forget(self, stream_id: int) -> _Call | None:
        """The call, no more ours; its unacknowledged bytes given back to the connection."""
        call = self._calls.pop(stream_id, None)
        if call is not None and call.unacked and not self.ended:
            self._h2.acknowledge(call.unacked, stream_id)
            call.unacked = 0
        return call

    def _end(self, stream_id: int, call: _Call, code: StatusCode, message: str) -> None:
        self._forget(stream_id)
        if not self._still_open(stream_id):
            return
        if not call.headers_sent:
            block = encode_headers(trailers_only(code, message))
        elif code == StatusCode.OK and not message:
            block = _OK_TRAILERS
        else:
            block = encode_headers(trailers(code, message))
        self._h2.send_headers(stream_id, block, end_stream=True)
        self._stop_request(stream_id)

    def _still_open(self, stream_id: int) -> bool:
        """Whether we may still send on the stream. Asked of the HTTP/2 state, not of our
        calls: while we read the events of some bytes, it has already read them all, and a
        RST_STREAM later in the same bytes has already closed the stream."""
        return self._h2.may_send(stream_id)

    def _stop_request(self, stream_id: int) -> None:
        """After a complete answer, RFC 9113 8.1 lets a server tell the client, with
        NO_ERROR, to stop sending the rest of its request (if it has not ended it)."""
        self._h2.reset(stream_id, ErrorCode.NO_ERROR)
