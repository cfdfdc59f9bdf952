"""Whether a backend's engine should start one more of our requests now, and whether it
reports room. Pure: the caller passes the backend and `now`.

Design rules (app/README.md, *Admission*, has the measurements behind 3):
1. What is ours is known, not estimated: the proxy counts its own requests on an engine as
   they are sent, start (their first byte) and end (`Backend.sent/started/ended`). The
   engine's last report adds what it runs and queues for others, as of that report; a report
   older than `STALE_REPORT_S` adds nothing (`Backend.on_engine`).
2. The room is the engine's own (room.py): stated by it, or seen when it refused to run
   more. Unknown, nothing is held for it: its own queue is the fallback.
3. Full means everyone's requests on it reach its room and `max_queued` of ours beyond the
   room have not started (`queued_ours`): at most that many of ours wait in the engine's
   queue, the rest at the proxy in fair order. A request that starts lets the next go at
   once, so each start is a probe of more room. While requests of ours are held and the
   engine serves no one else, none of ours waits in its queue (`queue_allowance`): the fair
   queue, not the engine's arrival order, picks who takes each sequence that frees; one goes
   there every `PROBE_EVERY_S` all the same, and while the room is from before a restart.
4. A report asked for after our last change on the engine, showing free sequences and an
   empty queue, never holds a request (`reports_room` says when that holds; the gate counts
   any time it held a request meanwhile, which should be none).
5. A KV cache this full (`max_kv_usage`) takes no more while it queues or we sent since,
   and until one of ours ends: vLLM would preempt a running sequence to fit another.
6. `--max-inflight-per-backend`, when given, is a ceiling on top: our own requests on it.
"""

from __future__ import annotations

from typing import Literal

from app.fleet.backends import Backend

Saturation = Literal["ceiling", "kv", "full"]
# While requests are held and none of ours waits in an engine's queue, one goes there this
# often all the same: a room learnt too small (a batch bound by KV memory then) is found out
# by the engine running it, which nothing else would send it while requests are held.
PROBE_EVERY_S = 5.0


def queued_ours(backend: Backend, now: float) -> int:
    """How many of our requests on `backend` may be waiting in its engine's own queue: those
    not started yet, as many as everyone's requests on it are beyond its room."""
    room = backend.room.room
    if room is None:
        return 0
    return max(0, min(backend.unstarted, backend.on_engine(now) - room))


def queue_allowance(backend: Backend, now: float, max_queued: int, held: bool) -> int:
    """How many of ours may wait in the engine's own queue: `max_queued`, or none while
    requests of ours are `held` at the proxy and the engine runs no one else's (its current
    report counted nothing beyond ours), but for a probe of more room every PROBE_EVERY_S
    and while its room is the one it had before a restart."""
    if not held or backend.room.provisional or now - backend.probed_at >= PROBE_EVERY_S:
        return max_queued
    if backend.report_current(now) and backend.others_inflight > 0:
        return max_queued
    return 0


def saturation(
    backend: Backend,
    now: float,
    ceiling: int | None,
    max_kv_usage: float,
    max_queued: int,
) -> Saturation | None:
    """Why `backend` should start no more of our requests now, or None when it may."""
    if ceiling is not None and backend.inflight >= ceiling:
        return "ceiling"
    engine = backend.engine
    if engine is not None and backend.report_current(now):
        usage = engine.kv_cache_usage
        sent_since = backend.inflight > backend.inflight_at_report
        freed = backend.inflight < backend.inflight_at_report
        queue = backend.reported_waiting > 0
        if usage is not None and usage >= max_kv_usage and not freed and (queue or sent_since):
            return "kv"
    room = backend.room.room
    at_room = room is not None and backend.on_engine(now) >= room
    return "full" if at_room and queued_ours(backend, now) >= max_queued else None


def reports_room(backend: Backend, now: float, max_kv_usage: float) -> bool:
    """Whether its engine's last report, asked for after our last change on it, shows free
    sequences, an empty queue and KV room."""
    engine = backend.engine
    if engine is None or not backend.report_fresh or not backend.report_current(now):
        return False
    room = backend.room.room
    usage = engine.kv_cache_usage
    return (
        backend.reported_waiting == 0
        and (room is None or backend.reported_running < room)
        and (usage is None or usage < max_kv_usage)
    )
