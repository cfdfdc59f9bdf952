"""One client connection on the server's side: its state, as a table, and its timer.

Design rules (h11's `_state.py` is the model):
1. A connection is in one `Phase` at a time, and only `ClientConnection._apply` changes it,
   by looking up (phase, event) in `TRANSITIONS`. An event the table does not list for the
   phase is a bug of ours and raises `StateError`; nothing else assigns the phase.
2. The server (server.py), the exchange (exchange.py) and the connection's own timer report
   what happened, as events; what each phase means for them is read off the phase: whether
   the connection expires and when, whether the answer in progress is its last, whether
   another request may be read.
3. Entering CLOSED cancels the connection's scope, whoever caused it: the answer in
   progress, its backend's work and the timer stop with it. The server closes the socket.

    phase        what is going on                                 the timer
    IDLE         between requests, nothing of the next head yet   keep-alive timeout
    HEAD         part of a head has arrived                       read timeout from its first byte
    ANSWERING    a whole head: its handler reads the body, answers (none while it answers)
    LAST_ANSWER  the same, and the connection ends after it       (none)
    CLOSED       nothing more is read or answered                 -

What the bytes are (the unread buffer, the request body's decoder) is data, not phase: the
head and body readers are pure (request_head.py, framing.py) and are fed `unread`.
"""

from __future__ import annotations

import contextlib
import enum
import json
from dataclasses import dataclass
from http import HTTPStatus

import trio

from app.errors import ClientError, SluiceError, answer_for
from app.http.fields import field_lines
from app.http.framing import BodyDecoder
from app.http.request_head import HeadReader, RequestHead
from app.http.streams import ByteStream

CLOSE = (b"connection", b"close")


class Phase(enum.Enum):
    IDLE = "idle"
    HEAD = "head"
    ANSWERING = "answering"
    LAST_ANSWER = "last answer"
    CLOSED = "closed"


class Event(enum.Enum):
    BYTES = "the first bytes of a head arrived"
    HEAD_WHOLE = "a whole head was read"
    MUST_CLOSE = "the answer in progress must be the last"
    ANSWERED = "the answer went out whole"
    FAILED = "the answer could not be finished"
    REFUSED = "a head that cannot be read was refused"
    EXPIRED = "the timer ran out"
    PEER_LEFT = "the client closed its side"
    SHUTDOWN = "the server is shutting down"


IDLE, HEAD, ANSWERING, LAST_ANSWER, CLOSED = Phase
TRANSITIONS: dict[Phase, dict[Event, Phase]] = {
    IDLE: {
        Event.BYTES: HEAD,
        Event.HEAD_WHOLE: ANSWERING,  # a pipelined head, whole behind the last answer
        Event.REFUSED: CLOSED,
        Event.EXPIRED: CLOSED,
        Event.PEER_LEFT: CLOSED,
        Event.SHUTDOWN: CLOSED,
    },
    HEAD: {
        Event.HEAD_WHOLE: ANSWERING,
        Event.REFUSED: CLOSED,
        Event.EXPIRED: CLOSED,
        Event.PEER_LEFT: CLOSED,
        Event.SHUTDOWN: CLOSED,
    },
    ANSWERING: {
        Event.MUST_CLOSE: LAST_ANSWER,
        Event.SHUTDOWN: LAST_ANSWER,
        Event.ANSWERED: IDLE,
        Event.FAILED: CLOSED,
        Event.PEER_LEFT: CLOSED,
    },
    LAST_ANSWER: {
        Event.MUST_CLOSE: LAST_ANSWER,
        Event.SHUTDOWN: LAST_ANSWER,
        Event.ANSWERED: CLOSED,
        Event.FAILED: CLOSED,
        Event.PEER_LEFT: CLOSED,
    },
    # Whatever still happens to a closed connection changes nothing.
    CLOSED: {event: CLOSED for event in Event},
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
    """An event the phase does not allow: a bug of the server's, never of a client's."""


class ClientConnection:
    """The server's side of one connection, served by one task (server.py).

    That task reads a request's head and body into `unread` (`read_some`), runs the handler,
    and reads the next; what a client pipelines meanwhile waits in the kernel. A second task
    runs the connection's timer (`run_timer`), and the server's departure watcher reports a
    client that leaves (`peer_left`).
    """

    def __init__(self, stream: ByteStream, limits: Limits = DEFAULT_LIMITS) -> None:
        self.stream = stream
        self.phase = IDLE
        self.unread = b""
        self.peer_gone = False  # the client's end of input was read
        self.keep_alive_timeout = limits.keep_alive_timeout
        self.read_timeout = limits.read_timeout
        self._heads = HeadReader(limits.max_head_bytes)
        # The body of the request being answered; None between requests.
        self._body: BodyDecoder | None = None
        self.continue_expected = False  # the client waits for 100 Continue before its body
        # Cancelled on entering CLOSED (`serving` sets it).
        self._scope: trio.CancelScope | None = None
        # What the timer expires the connection by: when it last went idle, when the first
        # byte of a head still unfinished came, and the timer's sleep.
        self._idle_since = trio.current_time()
        self._head_started = 0.0
        self._timer: trio.CancelScope | None = None

    def _apply(self, event: Event) -> None:
        try:
            phase = TRANSITIONS[self.phase][event]
        except KeyError:
            raise StateError(f"{event.value} while {self.phase.value}") from None
        self.phase = phase
        if phase is CLOSED and self._scope is not None:
            self._scope.cancel()

    @property
    def answering(self) -> bool:
        return self.phase is ANSWERING or self.phase is LAST_ANSWER

    @property
    def last_answer(self) -> bool:
        """Whether the answer in progress is the connection's last (or it has closed)."""
        return self.phase is not ANSWERING

    # --- reading ---------------------------------------------------------------------------

    def serving(self, scope: trio.CancelScope) -> None:
        """The scope of the task serving this connection, cancelled when it closes."""
        self._scope = scope
        if self.phase is CLOSED:
            scope.cancel()

    async def read_some(self) -> None:
        """Append what has arrived to `unread`; the end of input is the client leaving."""
        try:
            data = await self.stream.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.peer_gone = True
            if not self.answering:  # a body read notices it itself (ClientGone)
                self._apply(Event.PEER_LEFT)
            return
        self.unread += data

    def next_request(self) -> RequestHead | None:
        """The next request's head once `unread` holds it whole, else None. A head that is
        not HTTP/1.1 raises `ClientError`; the caller refuses it (`refuse`)."""
        head, taken = self._heads.parse(self.unread)
        if taken:
            self.unread = self.unread[taken:]
        if head is None:
            if self.unread and self.phase is IDLE:  # empty lines before a head do not count
                self._head_began()
            return None
        self._body = head.body_decoder()
        self.continue_expected = head.expects_continue and not self._body.done and not self.unread
        self._apply(Event.HEAD_WHOLE)
        if not head.keep_alive:
            self._apply(Event.MUST_CLOSE)
        if self.peer_gone:  # pipelined, and the client has left since: nobody to answer
            self._apply(Event.PEER_LEFT)
        return head

    @property
    def request_read(self) -> bool:
        """Whether the request being answered was read to the end of its body."""
        return self._body is None or self._body.done

    def take_body(self) -> list[bytes]:
        """The body bytes `unread` holds for the request being answered (FramingError for a
        malformed chunked body); what follows its end stays unread."""
        body = self._body
        if body is None or body.done or not self.unread:
            return []
        self.continue_expected = False
        pieces = body.feed(self.unread)
        self.unread = body.leftover
        body.leftover = b""
        return pieces

    # --- what happened ---------------------------------------------------------------------

    def must_close(self) -> None:
        """The answer being made ends the connection (its framing or the request says so)."""
        self._apply(Event.MUST_CLOSE)

    def answered(self, complete: bool) -> None:
        """The handler returned: with its answer whole (the connection may go on, unless it
        was the last), or not (it must end: the client cannot tell where the answer stops)."""
        self._body = None
        self._apply(Event.ANSWERED if complete else Event.FAILED)
        if self.phase is IDLE:
            self._idle_since = trio.current_time()

    def peer_left(self) -> None:
        """The client closed or reset its connection (the server's departure watcher)."""
        self.peer_gone = True
        self._apply(Event.PEER_LEFT)

    def shutdown(self) -> None:
        """The server stops: an idle connection closes now, an answer in flight is the last."""
        self._apply(Event.SHUTDOWN)

    async def refuse(self, error: ClientError) -> None:
        """An error answer to a request that could not be read; the connection then closes."""
        answer = answer_for(error)
        body = json.dumps(answer.body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        headers += answer.headers
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.stream.send(response_head(answer.status, [*headers, CLOSE]) + body)
        self._apply(Event.REFUSED)

    # --- the timer -------------------------------------------------------------------------

    def _head_began(self) -> None:
        """A head began and is not whole yet: it has the read timeout from its first byte,
        sooner than the keep-alive timeout the timer may be waiting for."""
        self._head_started = trio.current_time()
        self._apply(Event.BYTES)
        if self._timer is not None:
            self._timer.deadline = min(self._timer.deadline, self._expiry())

    def _expiry(self) -> float:
        if self.phase is HEAD:
            return self._head_started + self.read_timeout
        if self.phase is IDLE:
            return self._idle_since + self.keep_alive_timeout
        # Answering: the earliest an answer that has not ended yet can make it expire.
        return trio.current_time() + min(self.keep_alive_timeout, self.read_timeout)

    async def run_timer(self) -> None:
        """End the connection, with a 408 when a head was left unfinished, once it has been
        idle past its expiry.

        A task per connection rather than a deadline on every read: requests move the expiry
        with a plain assignment, and the timer wakes about once per timeout period to look,
        where a cancel scope per read cost every request ~10 µs of Trio's deadline
        bookkeeping."""
        while self.phase is not CLOSED:
            with trio.CancelScope(deadline=self._expiry()) as sleeping:
                self._timer = sleeping
                await trio.sleep_forever()
            self._timer = None
            if self.answering or trio.current_time() < self._expiry():
                continue
            if self.phase is HEAD:
                late = f"The request head did not arrive within {self.read_timeout:g}s."
                with trio.move_on_after(self.read_timeout):
                    await self.refuse(ClientError(late, code="request_timeout", status=408))
            self._apply(Event.EXPIRED)


def response_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """Status line and header lines; names and values are the server's own or came through a
    parser that validated them (fields.py)."""
    lines = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b""))]
    lines += field_lines(headers)
    lines.append(b"\r\n")
    return b"".join(lines)


_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
