"""One HTTP/2 connection, server side, without I/O (RFC 9113): bytes in, events out.

The gRPC server's transport (grpc_connection.py turns these events into calls). Written
here rather than taken from `h2` for its cost: following 200 streamed answers, every chunk
crosses the picker twice as a DATA frame, and h2's work per frame was ~30% of the picker's
loop; this reads and writes a DATA frame in a few microseconds.

Design rules:
1. Only what a gRPC server needs: requests arrive as HEADERS (+ CONTINUATION), DATA and
   maybe trailers; we send HEADERS, DATA, trailers, RST_STREAM, GOAWAY, and answer SETTINGS
   and PING. PRIORITY and unknown frames are read and ignored; a client's PUSH_PROMISE is
   its protocol error.
2. Every header block is decoded, a closed stream's too, so that our HPACK table stays the
   peer's. What we send is never indexed (http2_frames.py): it needs no table.
3. A peer's error against the connection queues GOAWAY with its code and ends the
   connection (`ConnectionTerminated(error=True)`); against one stream, RST_STREAM and
   `StreamReset` for that stream only. The peer's GOAWAY ends the connection too: after it
   nothing more is sent.
4. Flow control, inbound: each stream and the connection grant windows; a DATA frame past
   one is the peer's error. The caller gives bytes back as its handler takes them
   (`acknowledge`): a stream's window once half of it is owed, the connection's once a
   quarter is (many calls hold bytes at once). A closed stream's bytes are given back to
   the connection here, since nobody reads them. Outbound: `send_data` sends what both
   the peer's windows allow and says how much; `WindowUpdated` says when more may fit.
5. The stream cap we advertise is enforced once the peer has acknowledged our SETTINGS:
   streams it opened before it knew the cap are let in. After our GOAWAY (`go_away`, a
   server stopping) every new stream is refused.
"""

from __future__ import annotations

import dataclasses

from hpack import Decoder, HPACKError

from app.epp.http2_frames import (
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    FRAME_HEAD,
    HEAD_BYTES,
    LARGEST_MAX_FRAME,
    LARGEST_WINDOW,
    PREFACE,
    TABLE_SIZE_ZERO,
    ConnectionError_,
    ErrorCode,
    Flag,
    FrameType,
    Setting,
    StreamError,
    frame,
    goaway,
    rst_stream,
    settings,
    unpadded,
    window_update,
)

Headers = list[tuple[bytes, bytes]]


@dataclasses.dataclass(slots=True)
class RequestReceived:
    stream_id: int
    headers: Headers


@dataclasses.dataclass(slots=True)
class DataReceived:
    stream_id: int
    data: bytes
    flow_controlled_length: int  # padding included: what `acknowledge` gives back


@dataclasses.dataclass(slots=True)
class StreamEnded:  # the peer has sent all of its request
    stream_id: int


@dataclasses.dataclass(slots=True)
class StreamReset:  # the peer reset the stream, or we did for its error
    stream_id: int


@dataclasses.dataclass(slots=True)
class WindowUpdated:  # a window of the peer's grew: blocked sends may go on
    pass


@dataclasses.dataclass(slots=True)
class ConnectionTerminated:
    error: bool  # the peer broke the protocol (our GOAWAY is queued), else it said GOAWAY


Event = (
    RequestReceived
    | DataReceived
    | StreamEnded
    | StreamReset
    | WindowUpdated
    | ConnectionTerminated
)


@dataclasses.dataclass(frozen=True, slots=True)
class LocalSettings:
    max_concurrent_streams: int
    stream_window: int
    connection_window: int
    max_header_list_bytes: int


@dataclasses.dataclass(slots=True)
class _Stream:
    inbound_window: int
    outbound_window: int
    owed: int = 0  # bytes taken and not yet given back to the peer
    remote_closed: bool = False
    local_closed: bool = False


@dataclasses.dataclass(slots=True)
class _HeaderBlock:  # a HEADERS frame whose CONTINUATION frames are still to come
    stream_id: int
    end_stream: bool
    parts: list[bytes]
    size: int


class ServerConnection:
    def __init__(self, local: LocalSettings) -> None:
        self.local = local
        self.closed = False
        self._streams: dict[int, _Stream] = {}
        self._last_stream_id = 0
        self._inbound = bytearray()
        self._outbound = bytearray()
        self._preface_read = False
        self._peer_settings_read = False  # the peer's preface ends with its SETTINGS
        self._settings_acked = False
        self._going_away = False
        self._table_size_owed = False  # the peer set HEADER_TABLE_SIZE: say ours is 0
        self._decoder = Decoder(max_header_list_size=local.max_header_list_bytes)
        self._block: _HeaderBlock | None = None
        self._inbound_window = local.connection_window
        self._owed_to_connection = 0
        self._outbound_window = DEFAULT_WINDOW
        self._peer_stream_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._outbound += settings(
            [
                (Setting.MAX_CONCURRENT_STREAMS, local.max_concurrent_streams),
                (Setting.INITIAL_WINDOW_SIZE, local.stream_window),
                (Setting.MAX_HEADER_LIST_SIZE, local.max_header_list_bytes),
                (Setting.ENABLE_PUSH, 0),
            ]
        )
        if local.connection_window > DEFAULT_WINDOW:
            self._outbound += window_update(0, local.connection_window - DEFAULT_WINDOW)

    # -- reading -------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """What the peer's bytes mean, in order; answers the protocol owes (SETTINGS and
        PING acknowledgements, window updates, resets) are queued in `data_to_send()`."""
        if self.closed:
            return []
        self._inbound += data
        events: list[Event] = []
        try:
            if self._preface_read or self._read_preface():
                self._read_frames(events)
        except ConnectionError_ as error:
            self.close(error.code)
            events.append(ConnectionTerminated(error=True))
        return events

    def _read_preface(self) -> bool:
        got = bytes(self._inbound[: len(PREFACE)])
        if not PREFACE.startswith(got):
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "not HTTP/2's connection preface")
        if len(got) < len(PREFACE):
            return False
        del self._inbound[: len(PREFACE)]
        self._preface_read = True
        return True

    def _read_frames(self, events: list[Event]) -> None:
        buffer, at, size = self._inbound, 0, len(self._inbound)
        try:
            while size - at >= HEAD_BYTES and not self.closed:
                high, low, kind, flags, stream_id = FRAME_HEAD.unpack_from(buffer, at)
                length = high << 8 | low
                if length > DEFAULT_MAX_FRAME:  # the most we allow (we never raise it)
                    raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "frame too large")
                end = at + HEAD_BYTES + length
                if end > size:
                    break
                payload = bytes(buffer[at + HEAD_BYTES : end])
                at = end
                self._frame(kind, flags, stream_id & LARGEST_WINDOW, payload, events)
        finally:
            del buffer[:at]

    def _frame(
        self, kind: int, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        if self._block is not None and kind != FrameType.CONTINUATION:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a header block was cut")
        if not self._settings_seen_first(kind):
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "SETTINGS must come first")
        try:
            if kind == FrameType.DATA:
                self._data(flags, stream_id, payload, events)
            elif kind == FrameType.HEADERS:
                self._headers(flags, stream_id, payload, events)
            elif kind == FrameType.CONTINUATION:
                self._continuation(flags, stream_id, payload, events)
            elif kind == FrameType.WINDOW_UPDATE:
                self._window_update(stream_id, payload, events)
            else:
                self._control(kind, flags, stream_id, payload, events)
        except StreamError as error:
            self._reset(stream_id, error.code, events)

    def _settings_seen_first(self, kind: int) -> bool:
        if not self._peer_settings_read:
            self._peer_settings_read = kind == FrameType.SETTINGS
        return self._peer_settings_read

    def _data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        size = len(payload)
        if size > self._inbound_window:
            raise ConnectionError_(ErrorCode.FLOW_CONTROL_ERROR, "past the connection window")
        self._inbound_window -= size
        data = unpadded(flags, payload)
        stream = self._open_stream(stream_id)
        if stream is None or stream.remote_closed:
            self.acknowledge(size)  # nobody will read it
            if stream is not None:
                raise StreamError(ErrorCode.STREAM_CLOSED, "DATA after the request ended")
            return
        if size > stream.inbound_window:
            self.acknowledge(size)
            raise StreamError(ErrorCode.FLOW_CONTROL_ERROR, "past the stream window")
        stream.inbound_window -= size
        if size:
            events.append(DataReceived(stream_id, data, size))
        if flags & Flag.END_STREAM:
            self._remote_end(stream_id, stream, events)

    def _open_stream(self, stream_id: int) -> _Stream | None:
        """The stream if open; None if it was and is no more; an idle stream is an error."""
        if stream_id == 0 or stream_id > self._last_stream_id:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a frame for an idle stream")
        return self._streams.get(stream_id)

    def _headers(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        block = unpadded(flags, payload)
        if flags & Flag.PRIORITY:
            if len(block) < 5:
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short")
            block = block[5:]
        end_stream = bool(flags & Flag.END_STREAM)
        if flags & Flag.END_HEADERS:
            self._header_block(stream_id, end_stream, block, events)
        else:
            self._block = _HeaderBlock(stream_id, end_stream, [block], len(block))

    def _continuation(
        self, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        block = self._block
        if block is None or block.stream_id != stream_id:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "CONTINUATION out of place")
        block.parts.append(payload)
        block.size += len(payload)
        # HPACK's decoder bounds the decoded list; this bounds the encoded block it gets.
        if block.size > 2 * self.local.max_header_list_bytes:
            raise ConnectionError_(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if flags & Flag.END_HEADERS:
            self._block = None
            self._header_block(stream_id, block.end_stream, b"".join(block.parts), events)

    def _header_block(
        self, stream_id: int, end_stream: bool, block: bytes, events: list[Event]
    ) -> None:
        try:
            fields = self._decoder.decode(block, raw=True)
            headers = [(bytes(name), bytes(value)) for name, value in fields]
        except HPACKError as error:
            raise ConnectionError_(ErrorCode.COMPRESSION_ERROR, str(error)) from None
        if stream_id > self._last_stream_id:
            self._new_stream(stream_id, end_stream, headers, events)
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # trailers racing our reset of the stream
        if stream.remote_closed:
            raise StreamError(ErrorCode.STREAM_CLOSED, "HEADERS after the request ended")
        if not end_stream:
            raise StreamError(ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM")
        self._remote_end(stream_id, stream, events)

    def _new_stream(
        self, stream_id: int, end_stream: bool, headers: Headers, events: list[Event]
    ) -> None:
        if stream_id % 2 == 0:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a client opens odd streams")
        self._last_stream_id = stream_id
        full = self._settings_acked and len(self._streams) >= self.local.max_concurrent_streams
        if full or self._going_away:
            self._outbound += rst_stream(stream_id, ErrorCode.REFUSED_STREAM)
            return
        stream = _Stream(self.local.stream_window, self._peer_stream_window)
        self._streams[stream_id] = stream
        events.append(RequestReceived(stream_id, headers))
        if end_stream:
            self._remote_end(stream_id, stream, events)

    def _remote_end(self, stream_id: int, stream: _Stream, events: list[Event]) -> None:
        stream.remote_closed = True
        events.append(StreamEnded(stream_id))
        if stream.local_closed:
            del self._streams[stream_id]

    def _window_update(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a wrong size")
        increment = int.from_bytes(payload, "big") & LARGEST_WINDOW
        if stream_id == 0:
            if not increment or self._outbound_window + increment > LARGEST_WINDOW:
                raise ConnectionError_(ErrorCode.FLOW_CONTROL_ERROR, "a bad window increment")
            self._outbound_window += increment
        else:
            stream = self._open_stream(stream_id)
            if stream is None:
                return
            if not increment or stream.outbound_window + increment > LARGEST_WINDOW:
                raise StreamError(ErrorCode.FLOW_CONTROL_ERROR, "a bad window increment")
            stream.outbound_window += increment
        events.append(WindowUpdated())

    def _control(
        self, kind: int, flags: int, stream_id: int, payload: bytes, events: list[Event]
    ) -> None:
        if kind == FrameType.SETTINGS:
            self._settings(flags, stream_id, payload, events)
        elif kind == FrameType.PING:
            if stream_id != 0 or len(payload) != 8:
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a malformed PING")
            if not flags & Flag.ACK:
                self._outbound += frame(FrameType.PING, Flag.ACK, 0, payload)
        elif kind == FrameType.RST_STREAM:
            if len(payload) != 4:
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM of a wrong size")
            if self._open_stream(stream_id) is not None:
                del self._streams[stream_id]
                events.append(StreamReset(stream_id))
        elif kind == FrameType.GOAWAY:
            self.closed = True
            events.append(ConnectionTerminated(error=False))
        elif kind == FrameType.PUSH_PROMISE:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a client cannot push")

    def _settings(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id != 0:
            raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & Flag.ACK:
            if payload:
                raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS ack with data")
            self._settings_acked = True
            return
        if len(payload) % 6:
            raise ConnectionError_(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS of a wrong size")
        for at in range(0, len(payload), 6):
            key = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if key == Setting.INITIAL_WINDOW_SIZE:
                self._peer_window(value)
            elif key == Setting.MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= LARGEST_MAX_FRAME:
                    raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a bad MAX_FRAME_SIZE")
                self._peer_max_frame = value
            elif key == Setting.HEADER_TABLE_SIZE:
                self._table_size_owed = True
            elif key == Setting.ENABLE_PUSH and value > 1:
                raise ConnectionError_(ErrorCode.PROTOCOL_ERROR, "a bad ENABLE_PUSH")
        self._outbound += frame(FrameType.SETTINGS, Flag.ACK, 0, b"")
        events.append(WindowUpdated())  # a larger window or frame size: more may fit

    def _peer_window(self, value: int) -> None:
        if value > LARGEST_WINDOW:
            raise ConnectionError_(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
        change = value - self._peer_stream_window
        self._peer_stream_window = value
        for stream in self._streams.values():
            stream.outbound_window += change
            if stream.outbound_window > LARGEST_WINDOW:
                raise ConnectionError_(ErrorCode.FLOW_CONTROL_ERROR, "a window overflowed")

    def _reset(self, stream_id: int, code: ErrorCode, events: list[Event]) -> None:
        if self._streams.pop(stream_id, None) is not None:
            events.append(StreamReset(stream_id))
        self._outbound += rst_stream(stream_id, code)

    # -- writing -------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        data = bytes(self._outbound)
        self._outbound.clear()
        return data

    def acknowledge(self, size: int, stream_id: int = 0) -> None:
        """`size` bytes received are taken: the peer may send as many again."""
        stream = self._streams.get(stream_id) if stream_id else None
        if stream is not None and not stream.remote_closed:
            stream.owed += size
            if stream.owed >= self.local.stream_window // 2:
                stream.inbound_window += stream.owed
                self._outbound += window_update(stream_id, stream.owed)
                stream.owed = 0
        self._owed_to_connection += size
        if self._owed_to_connection >= self.local.connection_window // 4 and not self.closed:
            self._inbound_window += self._owed_to_connection
            self._outbound += window_update(0, self._owed_to_connection)
            self._owed_to_connection = 0

    def may_send(self, stream_id: int) -> bool:
        """Whether the stream is open for our answer (asked after every event of a read was
        read: a reset later in the same bytes has already closed it)."""
        stream = self._streams.get(stream_id)
        return stream is not None and not stream.local_closed and not self.closed

    def window(self, stream_id: int) -> int:
        stream = self._streams.get(stream_id)
        return 0 if stream is None else min(stream.outbound_window, self._outbound_window)

    def send_headers(self, stream_id: int, block: bytes, *, end_stream: bool = False) -> None:
        """An encoded header block (http2_frames.encode_headers), cut to the peer's frame
        size; with `end_stream` our side of the stream is over."""
        stream = self._streams[stream_id]
        if self._table_size_owed:
            # RFC 7541 4.2: a block after the peer's new HEADER_TABLE_SIZE begins with a
            # table size update; ours is 0 whatever the peer allows, since we never index.
            block = TABLE_SIZE_ZERO + block
            self._table_size_owed = False
        step = self._peer_max_frame
        flags = Flag.END_STREAM if end_stream else 0
        kind = FrameType.HEADERS
        for at in range(0, max(len(block), 1), step):
            last = at + step >= len(block)
            piece = block[at : at + step]
            if last:
                flags |= Flag.END_HEADERS
            self._outbound += frame(kind, flags, stream_id, piece)
            kind, flags = FrameType.CONTINUATION, 0
        if end_stream:
            stream.local_closed = True
            if stream.remote_closed:
                del self._streams[stream_id]

    def send_data(self, stream_id: int, data: bytes | memoryview) -> int:
        """Queue as much of `data` as the peer's windows allow; how much."""
        stream = self._streams[stream_id]
        size = min(len(data), stream.outbound_window, self._outbound_window)
        step = self._peer_max_frame
        for at in range(0, size, step):
            piece = data[at : min(at + step, size)]
            self._outbound += frame(FrameType.DATA, 0, stream_id, piece)
        stream.outbound_window -= size
        self._outbound_window -= size
        return size

    def reset(self, stream_id: int, code: ErrorCode) -> None:
        if self._streams.pop(stream_id, None) is not None and not self.closed:
            self._outbound += rst_stream(stream_id, code)

    def go_away(self) -> None:
        """GOAWAY without an error: the streams opened so far are served to their end,
        newer ones refused (the peer sends them on another connection)."""
        if not self.closed and not self._going_away:
            self._outbound += goaway(self._last_stream_id, ErrorCode.NO_ERROR)
            self._going_away = True

    def close(self, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """GOAWAY: no stream after the last we read will be served."""
        if not self.closed:
            self._outbound += goaway(self._last_stream_id, code)
            self.closed = True
