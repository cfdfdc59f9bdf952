"""The client connection's state table (app/http/connection.py), read alone.

As h11's `test_state.py` reads its table: every (phase, event) pair either leads where the
table says or raises `StateError`, and nothing reaches CLOSED without cancelling the scope
that serves the connection. Then the table's use: a connection fed a pipelined request, a
`Connection: close` request, a shutdown mid-answer and a client that leaves, over a memory
stream, with no server around it.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from app.http.connection import TRANSITIONS, ClientConnection, Event, Limits, Phase, StateError
from app.http.streams import StreamBytes

IDLE, HEAD, ANSWERING, LAST_ANSWER, CLOSED = Phase


def connection_in(phase: Phase) -> ClientConnection:
    _, server_end = trio.testing.memory_stream_pair()
    connection = ClientConnection(StreamBytes(server_end))
    connection.phase = phase
    return connection


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("event", list(Event))
async def test_every_pair_goes_where_the_table_says_or_is_refused(
    phase: Phase, event: Event
) -> None:
    connection = connection_in(phase)
    scope = trio.CancelScope()
    connection.serving(scope)
    allowed = TRANSITIONS[phase].get(event)
    if allowed is None:
        with pytest.raises(StateError):
            connection._apply(event)
        assert connection.phase is phase
    else:
        connection._apply(event)
        assert connection.phase is allowed
    assert scope.cancel_called is (connection.phase is CLOSED)


def test_only_an_answer_leads_back_to_idle_and_closed_is_the_end() -> None:
    into_idle = {(p, e) for p, row in TRANSITIONS.items() for e, q in row.items() if q is IDLE}
    assert into_idle == {(ANSWERING, Event.ANSWERED)}
    assert set(TRANSITIONS[CLOSED].values()) == {CLOSED}
    assert all(Event.PEER_LEFT in TRANSITIONS[phase] for phase in Phase)


async def read_head(connection: ClientConnection, client: trio.abc.Stream, data: bytes) -> None:
    await client.send_all(data)
    while connection.next_request() is None:
        await connection.read_some()


async def test_a_pipelined_request_and_a_close_request_walk_the_table() -> None:
    client, server_end = trio.testing.memory_stream_pair()
    connection = ClientConnection(StreamBytes(server_end))
    get = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"
    last = b"GET /b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    with trio.CancelScope() as scope:
        connection.serving(scope)
        await read_head(connection, client, get + last[:10])
        assert connection.phase is ANSWERING and not connection.last_answer
        connection.answered(complete=True)
        assert connection.phase is IDLE
        assert connection.next_request() is None  # half of the next head is here
        assert connection.phase is HEAD
        await read_head(connection, client, last[10:])
        assert connection.phase is LAST_ANSWER and connection.last_answer
        connection.answered(complete=True)
        assert connection.phase is CLOSED and scope.cancel_called


async def test_shutdown_marks_the_answer_in_flight_last_and_a_departure_closes() -> None:
    client, server_end = trio.testing.memory_stream_pair()
    connection = ClientConnection(StreamBytes(server_end))
    with trio.CancelScope() as scope:
        connection.serving(scope)
        await read_head(connection, client, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        connection.shutdown()
        assert connection.phase is LAST_ANSWER and not scope.cancel_called
        connection.peer_left()
        assert connection.phase is CLOSED and scope.cancel_called
        connection.shutdown()  # whatever comes after the end changes nothing
        assert connection.phase is CLOSED


async def test_the_timer_closes_an_idle_connection_after_the_keep_alive_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _, server_end = trio.testing.memory_stream_pair()
    connection = ClientConnection(StreamBytes(server_end), Limits(keep_alive_timeout=5))
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        connection.serving(nursery.cancel_scope)
        nursery.start_soon(connection.run_timer)
    assert connection.phase is CLOSED
    assert trio.current_time() - started == 5
