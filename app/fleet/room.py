"""How many sequences an engine runs at once, as Sluice judges it, and why. Pure: it is told
the engine's reports, the limit the engine states and its restarts; no clock, no I/O.

Design rules:
1. A stated limit wins. An engine that says how many sequences it runs (SGLang's
   `/get_server_info`, llama.cpp's `/props`, TGI's `/info`: engine_limits.py) has that room.
2. Otherwise the room is unknown until the engine is seen refusing to run more: a queue held
   over `REFUSALS_TO_LEARN` reports in a row while the running count stayed where it was, at
   the most the engine ever ran, and requests waited for room, not for a step: one of our
   own waited unstarted from one report to the next, or, where the engine says (vLLM's,
   TGI's histograms), its requests' mean time in the queue was at least `REFUSED_STEPS` of
   its steps (its mean gap between two tokens; that histogram is kept as requests finish,
   so it tells late). The room is then that most.
   A queue while the running count moves says nothing: under chunked prefill, requests wait
   a step for the token budget while others finish (measured: a burst of 1-token chats read
   that way as a room of 9 on an engine of 32, and streams were held for seconds behind
   it). Nor does a queue below its most (a batch bound by KV memory, which the KV use
   watches), nor one report. Nor a running count that only looks steady: a closed loop of
   short requests settles into batches of fixed sizes (19 and 13 on an engine of 32), and
   reports that happen to fall in the larger showed it "running 19, 13 waiting" three times
   in a row; but no request waited longer than a step there.
3. Never below what it demonstrably ran, and raised as soon as it runs more: an engine seen
   running more than its learnt room had more, and the room is unknown again until it
   refuses again. A stated room is at least what the engine was seen running.
4. A restart keeps the room, provisionally: the new process most likely runs with the old
   one's flags, and forgetting it sent every held request to the new engine at once
   (measured: the soak's GPU restarted with 8 sequences took 174 of ours, 166 into its own
   queue). What it ran starts again from nothing; refused at a lower most, the room is
   lowered to it (the new process runs fewer); running more than the room makes it unknown
   (more). A stated limit is read again. Restarts are told by the fleet's watchers (a
   counter that went back, a new start time, a health check that failed and passed again).
   An engine that no longer reports its load is forgotten.
5. Unknown is unbounded: nothing is held back for an engine whose room is unknown, and its
   own queue is the fallback.

The bases of a room and what moves them (anything else leaves the basis as it is):

    basis      event                                                 next basis
    ---------  ----------------------------------------------------  ----------
    unknown    `stated(n)`                                           stated
    seen-full  `stated(n)`                                           stated
    stated     `stated(None)`: it no longer says                     unknown
    unknown    `reported`: refusing at its most, REFUSALS_TO_LEARN   seen-full
               reports in a row, one of ours waiting all along
    seen-full  `reported`: ran more than the room                    unknown
    seen-full  `restarted`: provisional until refused or run past    seen-full
    any        `forgotten` (it reports no load)                      unknown
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

RoomBasis = Literal["unknown", "stated", "seen-full"]
# Reports in a row (0.5 s apart while traffic flows) that must show an engine refusing at
# its most before its room is taken to be that most.
REFUSALS_TO_LEARN = 2
# A request that waited this many steps in the queue was passed over by as many plans of the
# scheduler: refused room, not waiting a step for the token budget.
REFUSED_STEPS = 3.0
NEVER_SEEN_FULL = "never seen refusing: requests go to it, its own queue is the fallback"


@dataclass(frozen=True, slots=True)
class Seen:
    """One report as the room reads it."""

    running: int
    waiting: int
    ours_waited: bool  # one of our requests stayed unstarted since the report before
    queue_wait_s: float | None = None  # the engine's mean time in its queue, this interval
    step_s: float | None = None  # and its mean gap between two tokens

    @property
    def waited_for_room(self) -> bool:
        """Whether its requests waited for room rather than for the next step."""
        if self.ours_waited:
            return True
        if self.queue_wait_s is None or not self.step_s:
            return False
        return self.queue_wait_s >= REFUSED_STEPS * self.step_s


@dataclass
class EngineRoom:
    room: int | None = None  # None: unknown, unbounded
    basis: RoomBasis = "unknown"
    why: str = NEVER_SEEN_FULL
    most: int = 0  # the most it was seen running at once since it (re)started
    stated_limit: int | None = None
    stated_by: str = ""  # where the stated limit was read
    refusals: int = 0  # reports in a row that showed it refusing at its most
    restarts: int = 0  # how many times it was told of a restart
    provisional: bool = False  # the room is the one it had before it restarted
    _last_running: int | None = None

    def reported(self, seen: Seen) -> None:
        """One report of the engine."""
        running, waiting = seen.running, seen.waiting
        refusing_at_most = waiting > 0 and running >= self.most and running > 0
        refusing_at_most = refusing_at_most and seen.waited_for_room
        steady = running == self._last_running
        self.refusals = (self.refusals + 1 if steady else 1) if refusing_at_most else 0
        self._last_running = running
        self.most = max(self.most, running)
        if self.basis == "stated":
            assert self.stated_limit is not None
            if self.most > self.stated_limit:
                self.room = self.most
                self.why = f"{self.stated_by} states {self.stated_limit}; it ran {self.most}"
            return
        if self.basis == "seen-full" and self.room is not None and running > self.room:
            self._unknown(f"ran {running}, more than its room of {self.room} then")
            return
        learns = self.basis == "unknown" or self.provisional
        if self.refusals >= REFUSALS_TO_LEARN and learns:
            since = " since it restarted" if self.provisional else ""
            self.basis, self.room, self.provisional = "seen-full", self.most, False
            self.why = (
                f"ran {running} with {waiting} waiting in {self.refusals} reports in a row, "
                f"the most it ever ran{since}"
            )

    def stated(self, limit: int | None, by: str) -> None:
        """What the engine says of its own limit (None: it says nothing)."""
        if limit is None or limit < 1:
            if self.basis == "stated":
                self._unknown(f"{self.stated_by} no longer states a limit")
            self.stated_limit = None
            return
        self.stated_limit, self.stated_by = limit, by
        self.basis, self.room = "stated", max(limit, self.most)
        self.provisional = False
        self.why = f"{by} states {limit}"

    def restarted(self, what: str) -> None:
        """The engine restarted (or may have): its room is kept until it shows otherwise,
        and what it ran starts again."""
        self.restarts += 1
        self.most = 0
        self._last_running = None
        self.refusals = 0
        if self.room is None:
            self.why = f"{what}: room unknown until it states or shows it"
            return
        self.provisional = True
        self.why = f"{what}: {self.room} as before, until it shows otherwise"

    def forgotten(self, why: str) -> None:
        """Nothing more is known of it (it reports no load): its room is unknown."""
        self.most, self._last_running, self.stated_limit = 0, None, None
        self._unknown(why)

    def _unknown(self, why: str) -> None:
        self.basis, self.room, self.why = "unknown", None, why
        self.refusals = 0
        self.provisional = False

    def snapshot(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "basis": self.basis,
            "why": self.why,
            "most": self.most,
            "provisional": self.provisional,
        }
