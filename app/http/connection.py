"""One client connection on the server's side, as h11 keeps one: state and events in,
decisions out, no I/O and no clock (server.py reads, writes, runs the timer and acts).

Design rules (h11's `_state.py` is the model):
1. Two machines, each a table: the request as it is read (`READING_TRANSITIONS`) and the
   answer (`ANSWER_TRANSITIONS`). An event a table does not list for its machine's state is
   a bug of ours (`StateError`); only `_read` and `_answer` move a machine by an event.
2. One machine moves the other only through `COUPLED` (joint states, applied after the
   events that can reach them). No flags beside the two states: whatever the server asks
   (may another request be read, is this answer the last, does the client wait for 100
   Continue, was its body read, when does it expire) is read off them.
3. The bytes (the unread buffer, the body's decoder) are data, not state, fed to the pure
   readers (request_head.py, framing.py). A decision that is bytes (a refusal, 100
   Continue, a late head's 408) comes out once the states have moved; the server sends it.

    Reading    IDLE nothing of a head yet · HEAD part of one · EXPECTING the client waits
               for 100 Continue · BODY its body is arriving · DONE read whole · ENDED the
               client's input ended
    Answering  WAITING no whole head yet · ANSWERING · LAST the connection's last answer ·
               CLOSED nothing more is read or answered

Expiry: WAITING, nothing of a head: the keep-alive timeout after the last answer; part of a
head: the read timeout from its first byte, with a 408; while answering, never.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from http import HTTPStatus

from app.errors import ClientError, SluiceError, answer_for
from app.http.fields import field_lines
from app.http.framing import BodyDecoder
from app.http.request_head import HeadReader, RequestHead

CLOSE = (b"connection", b"close")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Reading(enum.Enum):
    IDLE = "nothing of a head yet"
    HEAD = "part of a head has arrived"
    EXPECTING = "the client waits for 100 Continue before its body"
    BODY = "its body is arriving"
    DONE = "read to the end of its body"
    ENDED = "the client's input ended"


class Answering(enum.Enum):
    WAITING = "no whole head to answer yet"
    ANSWERING = "a head is being answered"
    LAST = "a head is being answered, the connection's last"
    CLOSED = "nothing more is read or answered"


class ReadEvent(enum.Enum):
    HEAD_BEGAN = "the first bytes of a head arrived"
    HEAD_WHOLE = "a whole head, its body to come"
    HEAD_EXPECTING = "a whole head whose client waits for 100 Continue"
    HEAD_ALONE = "a whole head without a body"
    CONTINUE_SENT = "100 Continue went out"
    BODY_BYTES = "body bytes arrived, the body not whole yet"
    BODY_WHOLE = "the body arrived to its end"
    END_OF_INPUT = "the client's input ended"


class AnswerEvent(enum.Enum):
    REQUEST = "a whole head was read"
    MUST_CLOSE = "the answer in progress must be the last"
    ANSWERED = "the answer went out whole"
    FAILED = "the answer could not be finished"
    REFUSED = "a head that cannot be read was refused"
    EXPIRED = "the connection's time ran out"
    PEER_LEFT = "the client closed its side"
    SHUTDOWN = "the server is shutting down"


IDLE, HEAD, EXPECTING, BODY, DONE, ENDED = Reading
WAITING, ANSWERING, LAST, CLOSED = Answering

_HEADS = {
    ReadEvent.HEAD_WHOLE: BODY,
    ReadEvent.HEAD_EXPECTING: EXPECTING,
    ReadEvent.HEAD_ALONE: DONE,
    ReadEvent.END_OF_INPUT: ENDED,
}
READING_TRANSITIONS: dict[Reading, dict[ReadEvent, Reading]] = {
    # A pipelined head may be whole behind the last answer, without ever being partial.
    IDLE: {ReadEvent.HEAD_BEGAN: HEAD, **_HEADS},
    HEAD: _HEADS,
    EXPECTING: {
        ReadEvent.CONTINUE_SENT: BODY,
        ReadEvent.BODY_BYTES: BODY,  # the client did not wait
        ReadEvent.BODY_WHOLE: DONE,
        ReadEvent.END_OF_INPUT: ENDED,
    },
    BODY: {ReadEvent.BODY_WHOLE: DONE, ReadEvent.END_OF_INPUT: ENDED},
    DONE: {ReadEvent.END_OF_INPUT: ENDED},
    ENDED: {ReadEvent.END_OF_INPUT: ENDED},
}

_ENDINGS = {AnswerEvent.FAILED: CLOSED, AnswerEvent.PEER_LEFT: CLOSED}
ANSWER_TRANSITIONS: dict[Answering, dict[AnswerEvent, Answering]] = {
    WAITING: {
        AnswerEvent.REQUEST: ANSWERING,
        AnswerEvent.REFUSED: CLOSED,
        AnswerEvent.EXPIRED: CLOSED,
        AnswerEvent.PEER_LEFT: CLOSED,
        AnswerEvent.SHUTDOWN: CLOSED,
    },
    ANSWERING: {
        AnswerEvent.MUST_CLOSE: LAST,
        AnswerEvent.SHUTDOWN: LAST,
        AnswerEvent.ANSWERED: WAITING,
        **_ENDINGS,
    },
    LAST: {
        AnswerEvent.MUST_CLOSE: LAST,
        AnswerEvent.SHUTDOWN: LAST,
        AnswerEvent.ANSWERED: CLOSED,
        **_ENDINGS,
    },
    # Whatever still happens to a closed connection changes nothing.
    CLOSED: {event: CLOSED for event in AnswerEvent},
}

# Joint states that move both machines at once (h11's state-triggered transitions).
COUPLED: dict[tuple[Reading, Answering], tuple[Reading, Answering]] = {
    # The client's input ended between requests: nobody to answer.
    (ENDED, WAITING): (ENDED, CLOSED),
    # ... or mid-request: its answer may still go out, but no request follows it.
    (ENDED, ANSWERING): (ENDED, LAST),
    # An answer went out whole on a request read whole: the next request's head may come.
    # (An answer that leaves its request's body unread is the last: exchange.py makes it so.)
    (DONE, WAITING): (IDLE, WAITING),
}


@dataclass(frozen=True)
class Limits:
    """What a connection allows its client: idle time between requests, time for a head or
    a body to arrive, a head's size (h11's default, and hypercorn's)."""

    keep_alive_timeout: float = 75.0
    read_timeout: float = 30.0
    max_head_bytes: int = 16384


DEFAULT_LIMITS = Limits()


class StateError(SluiceError, RuntimeError):
    """An event the state does not allow: a bug of the server's, never of a client's."""


class ClientConnection:
    """The server's side of one connection: fed what arrives (`receive`) and what happened,
    it says what the bytes hold (`next_request`, `take_body`) and what to do."""

    __slots__ = (
        "_body",
        "_head_started",
        "_heads",
        "_idle_since",
        "answer",
        "keep_alive_timeout",
        "read_timeout",
        "reading",
        "unread",
    )

    def __init__(self, limits: Limits = DEFAULT_LIMITS, now: float = 0.0) -> None:
        self.reading = IDLE
        self.answer = WAITING
        self.unread = b""
        self.keep_alive_timeout = limits.keep_alive_timeout
        self.read_timeout = limits.read_timeout
        self._heads = HeadReader(limits.max_head_bytes)
        # The body of the request being answered; None between requests.
        self._body: BodyDecoder | None = None
        # What the connection expires by: when it last went idle, and when the first byte
        # of a head still unfinished came.
        self._idle_since = now
        self._head_started = now

    def _read(self, event: ReadEvent) -> None:
        try:
            self.reading = READING_TRANSITIONS[self.reading][event]
        except KeyError:
            raise StateError(f"{event.value} while {self.reading.value}") from None

    def _answer(self, event: AnswerEvent) -> None:
        try:
            self.answer = ANSWER_TRANSITIONS[self.answer][event]
        except KeyError:
            raise StateError(f"{event.value} while {self.answer.value}") from None

    def _settle(self) -> None:
        coupled = COUPLED.get((self.reading, self.answer))
        if coupled is not None:
            self.reading, self.answer = coupled

    # --- what the server asks ----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.answer is CLOSED

    @property
    def answering(self) -> bool:
        return self.answer is ANSWERING or self.answer is LAST

    @property
    def last_answer(self) -> bool:
        """Whether the answer in progress is the connection's last (or it has closed)."""
        return self.answer is not ANSWERING

    @property
    def request_read(self) -> bool:
        """Whether the request being answered was read to the end of its body."""
        return self.reading is DONE

    @property
    def input_ended(self) -> bool:
        return self.reading is ENDED

    # --- what arrives --------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """What the server read off the connection; b"" is the end of its input."""
        if self.answer is CLOSED:
            return
        if data:
            self.unread += data
            return
        self._read(ReadEvent.END_OF_INPUT)
        self._settle()

    def next_request(self, now: float) -> RequestHead | None:
        """The next request's head once `unread` holds it whole, else None. A head that is
        not HTTP/1.1 raises `ClientError`; the server refuses it (`refuse`)."""
        head, taken = self._heads.parse(self.unread)
        if taken:
            self.unread = self.unread[taken:]
        if head is None:
            if self.unread and self.reading is IDLE:  # empty lines before a head do not count
                self._head_started = now
                self._read(ReadEvent.HEAD_BEGAN)
            return None
        body = self._body = head.body_decoder()
        self._answer(AnswerEvent.REQUEST)
        if body.done:
            self._read(ReadEvent.HEAD_ALONE)
        elif head.expects_continue and not self.unread:
            self._read(ReadEvent.HEAD_EXPECTING)
        else:
            self._read(ReadEvent.HEAD_WHOLE)
        if not head.keep_alive:
            self._answer(AnswerEvent.MUST_CLOSE)
        return head

    def continue_reply(self) -> bytes:
        """What to send before reading the body: 100 Continue if the client waits for it
        (once), else nothing."""
        if self.reading is not EXPECTING:
            return b""
        self._read(ReadEvent.CONTINUE_SENT)
        return CONTINUE

    def take_body(self) -> list[bytes]:
        """The body bytes `unread` holds for the request being answered (FramingError for a
        malformed chunked body); what follows its end stays unread."""
        body = self._body
        reading = self.reading
        if body is None or not self.unread or (reading is not BODY and reading is not EXPECTING):
            return []
        pieces = body.feed(self.unread)
        self.unread = body.leftover
        body.leftover = b""
        if body.done:
            self._read(ReadEvent.BODY_WHOLE)
        elif reading is EXPECTING:
            self._read(ReadEvent.BODY_BYTES)
        return pieces

    # --- what happened -------------------------------------------------------------------------

    def must_close(self) -> None:
        """The answer being made ends the connection (its framing or the request says so)."""
        self._answer(AnswerEvent.MUST_CLOSE)

    def answered(self, complete: bool, now: float) -> None:
        """The handler returned: with its answer whole (the connection may go on, unless it
        was the last), or not (it must end: the client cannot tell where the answer stops)."""
        self._body = None
        self._answer(AnswerEvent.ANSWERED if complete else AnswerEvent.FAILED)
        if self.answer is WAITING:
            self._idle_since = now
            self._settle()

    def peer_left(self) -> None:
        """The client closed or reset its connection (the server's departure watcher)."""
        self._answer(AnswerEvent.PEER_LEFT)
        self._read(ReadEvent.END_OF_INPUT)

    def shutdown(self) -> None:
        """The server stops: an idle connection closes now, an answer in flight is the last."""
        self._answer(AnswerEvent.SHUTDOWN)

    def refuse(self, error: ClientError) -> bytes:
        """The connection closes on a request that could not be read: the error answer to
        send it."""
        self._answer(AnswerEvent.REFUSED)
        return refusal(error)

    # --- time ----------------------------------------------------------------------------------

    def expiry(self, now: float) -> float:
        """When the connection expires if nothing happens; while answering, the earliest an
        answer that has not ended yet can make it expire."""
        if self.answer is WAITING:
            if self.reading is HEAD:
                return self._head_started + self.read_timeout
            return self._idle_since + self.keep_alive_timeout
        return now + min(self.keep_alive_timeout, self.read_timeout)

    def time_out(self, now: float) -> bytes | None:
        """None unless the connection has expired by `now`; else it has closed, and this is
        what to send first: a 408 for a head left unfinished, or nothing."""
        if self.answer is not WAITING or now < self.expiry(now):
            return None
        late = self.reading is HEAD
        self._answer(AnswerEvent.EXPIRED)
        if not late:
            return b""
        message = f"The request head did not arrive within {self.read_timeout:g}s."
        return refusal(ClientError(message, code="request_timeout", status=408))


def refusal(error: ClientError) -> bytes:
    """A whole error answer that ends its connection."""
    answer = answer_for(error)
    body = json.dumps(answer.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    return response_head(answer.status, [*headers, *answer.headers, CLOSE]) + body


def response_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """Status line and header lines; names and values are the server's own or came through a
    parser that validated them (fields.py)."""
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b""))]
    lines += field_lines(headers)
    lines.append(b"\r\n")
    return b"".join(lines)


_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
