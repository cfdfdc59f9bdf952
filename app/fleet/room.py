"""How many sequences an engine runs at once, as Sluice judges it, and why. Pure: it is told
the engine's reports, the limit the engine states and its restarts; no clock, no I/O.

Design rules (app/README.md, *Admission*, tells what each one prevents):
1. A stated limit wins (SGLang's `/get_server_info`, llama.cpp's `/props`, TGI's `/info`:
   engine_limits.py), and is at least what the engine was seen running.
2. Otherwise the room is unknown until the engine is seen refusing to run more: a queue held
   over `REFUSALS_TO_LEARN` reports in a row, the running count unmoved at the most it ever
   ran, while requests waited for room and not for a step (one of ours unstarted from one
   report to the next, or a mean queue time of at least `REFUSED_STEPS` of its steps where
   the engine reports both). The room is then that most; running more makes it unknown.
3. A restart keeps the room, provisionally, until the new process refuses at a lower most
   (lowered) or runs past it (unknown). Unknown is unbounded: nothing is held back for it.

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
from typing import Literal, TypedDict

RoomBasis = Literal["unknown", "stated", "seen-full"]


class RoomSnapshot(TypedDict):
    """An engine's room as the dashboard shows it."""

    room: int | None  # None: unknown, unbounded
    basis: RoomBasis
    why: str
    most: int  # the most it was seen running
    provisional: bool  # the room from before a restart, until it shows otherwise


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

    def snapshot(self) -> RoomSnapshot:
        return {
            "room": self.room,
            "basis": self.basis,
            "why": self.why,
            "most": self.most,
            "provisional": self.provisional,
        }
