"""The client connection (app/http/connection.py), read alone: no stream, no clock, no Trio.

As h11's `test_state.py` reads its tables: every (state, event) pair of each machine either
leads where its table says or raises `StateError`, and the coupled joint states are the only
way one machine moves the other. Then, as h11's `test_io.py` (`t_body_reader`) feeds its
readers: each conversation is fed whole and then one byte at a time, and must give the same
heads, bodies and states. Then time, as plain numbers: when a connection expires, and what it
says to send when it does.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.errors import ClientError
from app.http.connection import (
    ANSWER_TRANSITIONS,
    CLOSE,
    CONTINUE,
    COUPLED,
    READING_TRANSITIONS,
    AnswerEvent,
    Answering,
    ClientConnection,
    Limits,
    ReadEvent,
    Reading,
    StateError,
)
from app.http.framing import FramingError
from app.http.request_head import RequestHead

IDLE, HEAD, EXPECTING, BODY, DONE, ENDED = Reading
WAITING, ANSWERING, LAST, CLOSED = Answering


# Each machine: its table, its events, and how the connection moves it by one of them.
MACHINES: dict[str, tuple[Any, type[enum.Enum], Callable[[ClientConnection, Any], None]]] = {
    "reading": (READING_TRANSITIONS, ReadEvent, ClientConnection._read),
    "answer": (ANSWER_TRANSITIONS, AnswerEvent, ClientConnection._answer),
}
PAIRS = [
    (machine, state, event)
    for machine, (table, events, _) in MACHINES.items()
    for state in table
    for event in events
]


@pytest.mark.parametrize(("machine", "state", "event"), PAIRS)
def test_every_pair_goes_where_its_table_says_or_is_refused(
    machine: str, state: enum.Enum, event: enum.Enum
) -> None:
    table, _, move = MACHINES[machine]
    connection = ClientConnection()
    setattr(connection, machine, state)
    allowed = table[state].get(event)
    if allowed is None:
        with pytest.raises(StateError):
            move(connection, event)
        assert getattr(connection, machine) is state
    else:
        move(connection, event)
        assert getattr(connection, machine) is allowed


def test_only_an_answer_leads_back_to_waiting_and_closed_is_the_end() -> None:
    into_waiting = {
        (s, e) for s, row in ANSWER_TRANSITIONS.items() for e, t in row.items() if t is WAITING
    }
    assert into_waiting == {(ANSWERING, AnswerEvent.ANSWERED)}
    assert set(ANSWER_TRANSITIONS[CLOSED].values()) == {CLOSED}
    assert all(AnswerEvent.PEER_LEFT in ANSWER_TRANSITIONS[state] for state in Answering)
    assert all(ReadEvent.END_OF_INPUT in READING_TRANSITIONS[state] for state in Reading)
    # Back to reading a head only by coupling: after an answer, on a request read whole.
    assert not any(t is IDLE for row in READING_TRANSITIONS.values() for t in row.values())
    assert [joint for joint, (reading, _) in COUPLED.items() if reading is IDLE] == [
        (DONE, WAITING)
    ]


def pieces(data: bytes, byte_by_byte: bool) -> Iterator[bytes]:
    if not byte_by_byte:
        yield data
        return
    for i in range(len(data)):
        yield data[i : i + 1]


def feed_head(connection: ClientConnection, data: bytes, byte_by_byte: bool) -> RequestHead:
    """`data` received as the server receives it, asking for a head after every read."""
    head = connection.next_request(0.0)
    for piece in pieces(data, byte_by_byte):
        assert head is None
        connection.receive(piece)
        head = connection.next_request(0.0)
    assert head is not None
    return head


def feed_body(connection: ClientConnection, data: bytes, byte_by_byte: bool) -> bytes:
    body = b"".join(connection.take_body())
    for piece in pieces(data, byte_by_byte):
        connection.receive(piece)
        body += b"".join(connection.take_body())
    return body


GET = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"
LAST_GET = b"GET /b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
CHUNKED = b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
EXPECT = b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n"


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_a_keep_alive_request_then_a_close_request_walk_both_machines(
    byte_by_byte: bool,
) -> None:
    connection = ClientConnection()
    head = feed_head(connection, GET, byte_by_byte)
    assert head.path == "/a" and connection.request_read
    assert (connection.reading, connection.answer) == (DONE, ANSWERING)
    assert not connection.last_answer
    connection.answered(complete=True, now=1.0)
    assert (connection.reading, connection.answer) == (IDLE, WAITING)
    head = feed_head(connection, LAST_GET, byte_by_byte)
    assert head.path == "/b" and connection.last_answer
    connection.answered(complete=True, now=2.0)
    assert connection.closed


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_a_chunked_body_and_the_pipelined_head_behind_it(byte_by_byte: bool) -> None:
    connection = ClientConnection()
    feed_head(connection, CHUNKED, byte_by_byte)
    assert connection.reading is BODY and not connection.request_read
    body = feed_body(connection, b"3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n" + GET, byte_by_byte)
    assert body == b"abcde" and connection.reading is DONE
    assert connection.unread == GET  # the next request waits, unread
    connection.answered(complete=True, now=1.0)
    assert connection.next_request(1.0) is not None
    assert connection.reading is DONE and connection.answer is ANSWERING


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_100_continue_is_asked_once_and_only_while_the_client_waits(byte_by_byte: bool) -> None:
    connection = ClientConnection()
    feed_head(connection, EXPECT, byte_by_byte)
    assert connection.reading is EXPECTING
    assert connection.continue_reply() == CONTINUE and connection.continue_reply() == b""
    assert feed_body(connection, b"ok", byte_by_byte) == b"ok" and connection.request_read
    # A client that sent some of its body with its head is not told to go on.
    connection = ClientConnection()
    feed_head(connection, EXPECT + b"o", byte_by_byte=False)
    assert connection.reading is BODY and connection.continue_reply() == b""


def test_a_malformed_chunked_body_is_a_framing_error_and_moves_nothing() -> None:
    connection = ClientConnection()
    feed_head(connection, CHUNKED, False)
    connection.receive(b"zz\r\n")
    with pytest.raises(FramingError):
        connection.take_body()
    assert (connection.reading, connection.answer) == (BODY, ANSWERING)


def test_the_end_of_input_closes_between_requests_and_makes_an_answer_the_last() -> None:
    connection = ClientConnection()
    connection.receive(b"GET / HT")
    assert connection.next_request(0.0) is None and connection.reading is HEAD
    connection.receive(b"")
    assert (connection.reading, connection.answer) == (ENDED, CLOSED)
    connection = ClientConnection()
    feed_head(connection, CHUNKED, False)
    connection.receive(b"")
    assert connection.input_ended and connection.answer is LAST
    connection.answered(complete=True, now=1.0)
    assert connection.closed


def test_shutdown_marks_the_answer_in_flight_last_and_a_departure_closes() -> None:
    connection = ClientConnection()
    feed_head(connection, GET, False)
    connection.shutdown()
    assert connection.answer is LAST
    connection.peer_left()
    assert (connection.reading, connection.answer) == (ENDED, CLOSED)
    connection.shutdown()  # whatever comes after the end changes nothing
    connection.receive(b"more")
    assert connection.closed and connection.unread == b""
    idle = ClientConnection()
    idle.shutdown()
    assert idle.closed


def test_a_refused_head_closes_with_its_error_answer() -> None:
    connection = ClientConnection()
    connection.receive(b"GARBAGE\r\n\r\n")
    with pytest.raises(ClientError) as refused:
        connection.next_request(0.0)
    answer = connection.refuse(refused.value)
    assert connection.closed
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"%b: %b" % CLOSE in head
    assert json.loads(body)["error"]["code"] == "bad_request"


LIMITS = Limits(keep_alive_timeout=75, read_timeout=5)


def test_an_idle_connection_expires_a_keep_alive_timeout_after_its_last_answer() -> None:
    connection = ClientConnection(LIMITS, now=10.0)
    assert connection.expiry(10.0) == 85.0
    assert connection.time_out(84.9) is None and not connection.closed
    feed_head(connection, GET, False)
    # While answering, never: the timer looks again a timeout period later.
    assert connection.expiry(200.0) == 205.0 and connection.time_out(500.0) is None
    connection.answered(complete=True, now=300.0)
    assert connection.expiry(301.0) == 375.0
    assert connection.time_out(375.0) == b"" and connection.closed


def test_a_head_left_unfinished_expires_a_read_timeout_after_its_first_byte_with_a_408() -> None:
    connection = ClientConnection(LIMITS, now=0.0)
    connection.receive(b"\r\n")  # an empty line before a head does not start it
    assert connection.next_request(3.0) is None and connection.reading is IDLE
    connection.receive(b"POST /slow HTTP/1.1\r\n")
    assert connection.next_request(4.0) is None and connection.expiry(4.0) == 9.0
    connection.receive(b"x: 1\r\n")
    assert connection.next_request(8.0) is None and connection.expiry(8.0) == 9.0
    farewell = connection.time_out(9.0)
    assert farewell is not None and farewell.startswith(b"HTTP/1.1 408 ")
    assert b'"request_timeout"' in farewell and connection.closed
