"""An engine's room learnt from its own reports (app/fleet/room.py) and the saturation judge
(app/fleet/saturation.py), pure: no task, no clock.

Covers: a room learnt only from a queue held while the engine ran at its most, never below what
it ran, grown when it runs more, a stated limit winning, restarts keeping the room until the
engine shows otherwise; an engine of unknown room taking everything, full meaning one of ours
waits in the engine's own queue, others filling that queue, the probe of more room while ours
are held, a fresh report of room never holding, and a nearly full KV cache holding only while
the engine queues or we sent since.
"""

from __future__ import annotations

from app.fleet.backends import Backend
from app.fleet.room import REFUSALS_TO_LEARN, EngineRoom, Seen
from app.fleet.saturation import (
    PROBE_EVERY_S,
    queue_allowance,
    queued_ours,
    reports_room,
    saturation,
)
from tests.gate_fakes import full, reported


def refusing(room: EngineRoom, running: int, waiting: int, reports: int) -> None:
    """Reports of a queue while one of ours waited unstarted all along."""
    for _ in range(reports):
        room.reported(Seen(running, waiting, True))


def test_a_room_is_learnt_only_from_a_queue_held_at_the_most_the_engine_ran() -> None:
    room = EngineRoom()
    refusing(room, 4, 9, REFUSALS_TO_LEARN - 1)
    assert room.room is None and room.basis == "unknown"  # not yet: could be a step's wait
    room.reported(Seen(4, 9, False, queue_wait_s=0.4, step_s=0.02))  # 20 steps in its queue
    assert (room.room, room.basis) == (4, "seen-full")
    assert "ran 4 with 9 waiting" in room.why


def test_a_queue_while_the_running_count_moves_or_below_its_most_teaches_nothing() -> None:
    """Chunked prefill: requests wait a step for the token budget while others finish, so
    the running count moves under a queue (measured: read as a full engine, a burst of
    1-token chats left a room of 9 on an engine of 32)."""
    room = EngineRoom()
    room.reported(Seen(20, 0, True))
    for running in (9, 12, 7, 9, 11, 9, 9, 9):  # below the 20 it ran: a KV-bound or step wait
        room.reported(Seen(running, 5, True))
    assert room.room is None
    for running in (20, 19, 20, 18, 20):  # at its most, but moving
        room.reported(Seen(running, 3, True))
    assert room.room is None
    for _ in range(5):  # steady at its most, but none of ours waited from one report to the next
        room.reported(Seen(20, 12, False))
    for _ in range(5):  # nor did the engine's own requests wait more than a step or two
        room.reported(Seen(20, 12, False, queue_wait_s=0.03, step_s=0.02))
    assert room.room is None
    refusing(room, 20, 3, REFUSALS_TO_LEARN)
    assert room.room == 20


def test_a_room_is_never_below_what_the_engine_ran_and_grows_when_it_runs_more() -> None:
    room = EngineRoom()
    refusing(room, 4, 2, REFUSALS_TO_LEARN)
    assert room.room == 4
    room.reported(Seen(3, 4, True))  # a queue below its room: never lowers it
    room.reported(Seen(4, 0, True))
    assert room.room == 4
    room.reported(Seen(6, 0, True))  # ran more than its room: it had more, how much is unknown
    assert (room.room, room.basis) == (None, "unknown")
    refusing(room, 8, 1, REFUSALS_TO_LEARN)
    assert room.room == 8


def test_a_stated_limit_wins_and_a_restart_keeps_the_room_until_it_shows_otherwise() -> None:
    room = EngineRoom()
    refusing(room, 4, 2, REFUSALS_TO_LEARN)
    room.stated(16, "/get_server_info")
    assert (room.room, room.basis, room.why) == (16, "stated", "/get_server_info states 16")
    refusing(room, 10, 3, REFUSALS_TO_LEARN)  # a queue below a stated limit: KV-bound
    assert room.room == 16
    room.reported(Seen(17, 0, True))  # it ran more than it said: never below what it ran
    assert room.room == 17
    room.restarted("its engine restarted")  # kept until the new process says
    assert (room.room, room.basis, room.most, room.restarts) == (17, "stated", 0, 1)
    room.stated(None, "/get_server_info")  # it no longer says: unknown
    assert (room.room, room.basis) == (None, "unknown")
    refusing(room, 8, 2, REFUSALS_TO_LEARN)
    room.restarted("it turned healthy")
    assert (room.room, room.basis, room.provisional) == (8, "seen-full", True)
    refusing(room, 2, 5, REFUSALS_TO_LEARN)  # restarted with fewer sequences
    assert (room.room, room.provisional) == (2, False) and "since it restarted" in room.why
    room.restarted("its engine restarted")
    room.reported(Seen(3, 0, True))  # restarted with more: it ran past the room
    assert (room.room, room.basis) == (None, "unknown")
    refusing(room, 6, 1, REFUSALS_TO_LEARN)
    room.forgotten("its engine reports no load")
    assert (room.room, room.basis, room.most) == (None, "unknown", 0)


def judge(backend: Backend, now: float = 0.0, ceiling: int | None = None) -> str | None:
    return saturation(backend, now, ceiling, 0.95, 1)


def test_an_engine_whose_room_is_unknown_takes_everything() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    assert judge(backend) is None  # no report: the engine decides
    for _ in range(50):
        backend.sent(0.0)
    reported(backend, 40, 10)  # a queue, but never seen refusing at its most
    assert judge(backend) is None and queued_ours(backend, 0.0) == 0


def test_full_means_one_of_ours_waits_in_the_engines_own_queue() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    full(backend, 4)
    reported(backend, 0, 0)
    for _ in range(4):
        backend.sent(0.0)
    assert judge(backend) is None  # four on an engine of four: the next waits there
    backend.sent(0.0)
    assert queued_ours(backend, 0.0) == 1 and judge(backend) == "full"
    backend.started(0.0)  # one of ours started: at most the fifth waits there
    assert judge(backend) == "full"
    backend.ended(0.0, started=True)  # a sequence freed: the fifth runs, room for a sixth
    assert queued_ours(backend, 0.0) == 0 and judge(backend) is None
    assert judge(backend, ceiling=4) == "ceiling"


def test_others_fill_the_queue_and_one_of_ours_still_waits_its_turn_there() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    full(backend, 4)
    reported(backend, 4, 30)  # others' requests: all it runs, and 30 waiting
    assert judge(backend) is None  # ours takes its place in the engine's queue
    backend.sent(0.0)
    assert queued_ours(backend, 0.0) == 1 and judge(backend) == "full"
    backend.started(0.0)  # it ran: the next of ours may wait there
    assert judge(backend) is None
    assert judge(backend, now=2.5) is None  # and once that report is stale, others count nil


def test_while_ours_are_held_none_waits_in_an_engine_that_runs_only_ours() -> None:
    """The fair queue, not the engine's arrival order, picks who takes a sequence that frees;
    one of ours waits there all the same every PROBE_EVERY_S (a probe of more room), and at
    an engine that others queue at."""
    backend = Backend("http://gpu-1:8000", healthy=True)
    full(backend, 4)
    reported(backend, 0, 0)
    for _ in range(5):
        backend.sent(0.0)  # the fifth past its room, waiting there: a probe of more room
    assert queue_allowance(backend, 0.0, 1, held=False) == 1
    assert queue_allowance(backend, 0.0, 1, held=True) == 0
    assert queue_allowance(backend, PROBE_EVERY_S, 1, held=True) == 1  # the next probe
    backend.ended(0.0, False)
    assert saturation(backend, 0.0, None, 0.95, 0) == "full"
    reported(backend, 4, 6)  # others' requests beside our four: it queues them
    assert queue_allowance(backend, 0.0, 1, held=True) == 1


def test_a_fresh_report_of_room_never_holds() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    full(backend, 4)
    for _ in range(6):
        backend.sent(0.0)
    assert judge(backend) == "full"
    reported(backend, 3, 0, at=1.0)  # asked after our last change: free and empty
    assert reports_room(backend, 1.0, 0.95) and judge(backend, 1.0) is None
    backend.sent(1.5)  # our change since: the report no longer says all
    assert not reports_room(backend, 1.5, 0.95)


def test_a_nearly_full_kv_cache_holds_only_while_it_queues_or_we_sent_since() -> None:
    backend = Backend("http://gpu-1:8000", healthy=True)
    for _ in range(3):
        backend.sent(0.0)
    reported(backend, 3, 0, kv=0.97)
    assert judge(backend) is None  # no queue, nothing sent since: it runs all it has
    backend.sent(0.1)
    assert judge(backend, 0.1) == "kv"  # sent since, into a nearly full cache
    reported(backend, 3, 1, kv=0.97, at=0.2)
    assert judge(backend, 0.2) == "kv"  # it queues
    backend.ended(0.3, started=True)
    assert judge(backend, 0.3) is None  # one of ours ended since: room again
    assert judge(backend, 2.3) is None  # and a stale report holds nothing
