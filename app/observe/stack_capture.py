"""The event-loop thread's Python stack, taken while the loop is stalled.

The loop thread takes its own stack, at the first moment it can: a thread-directed POSIX
timer (thread_timer.py) sends SIGALRM to the loop thread, and Python runs our handler on that
thread between two bytecodes, handing it the frame it interrupted: in a stall of Python code,
the stall's own frame; in one C call that holds the GIL (`json.loads` of a large body), the
frame that made the call, as soon as it returns, still inside the stalled step. The timer is
a dead-man's switch: the loop monitor restarts it each time the loop starts a run of steps
and pauses it while the loop sleeps (loop_monitor.py); a run that outlasts it is a stall.

Not a watchdog thread (none runs while a C call holds the GIL, and none may walk another
thread's frames safely), not faulthandler (it reads frames mid-instruction, and crashed the
proxy with SIGSEGV: app/README.md), not `setitimer(ITIMER_REAL)` (its signal goes to the
process, and only a signal sent to the loop thread interrupts a system call it is blocked in;
Python retries the call after the handler, PEP 475). The price: a loop that never returns
from a C call is never captured, and a Python handler needs the main thread.

One capture per process holds SIGALRM: `claim` returns the reason instead of a capture when
another capture does, when something else already uses SIGALRM (a Python handler or a
running alarm, e.g. pytest-timeout's signal method), when the loop is not on the main
thread, or where no thread-directed timer exists. The monitor then counts stalls without
stacks.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from app.observe.stalls import Frame
from app.observe.thread_timer import ThreadTimer

_owner_lock = threading.Lock()
_owner: LoopStackCapture | None = None
# A pending signal reaches a thread within microseconds; this only bounds a pathological mask.
_PENDING_ALARM_YIELDS = 1000


def own_stack(frame: FrameType | None) -> list[Frame]:
    """`frame` and its callers, innermost first."""
    frames = []
    while frame is not None:
        frames.append(Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


class LoopStackCapture:
    def __init__(self, timer: ThreadTimer) -> None:
        self._timer = timer
        self._taken: list[Frame] | None = None  # by the handler, since the last re-arm
        self._dumps = 0

    @classmethod
    def claim(cls, timeout_s: float) -> LoopStackCapture | str:
        """Take SIGALRM for the calling thread (the loop's) and arm it, or say why not."""
        global _owner
        if not hasattr(signal, "SIGALRM"):
            return "this platform has no SIGALRM"
        if threading.current_thread() is not threading.main_thread():
            return "the event loop is not on the main thread, where Python runs signal handlers"
        with _owner_lock:
            if _owner is not None:
                return "another monitor in this process owns SIGALRM"
            if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None) or any(
                signal.getitimer(signal.ITIMER_REAL)
            ):
                return "SIGALRM is already in use in this process"
            timer = ThreadTimer.create(threading.get_native_id(), signal.SIGALRM, timeout_s)
            if isinstance(timer, str):
                return timer
            _owner = capture = cls(timer)
        signal.signal(signal.SIGALRM, capture._on_alarm)
        capture.rearm()
        return capture

    @property
    def dumps(self) -> int:
        """How many times the alarm fired and the loop thread took its stack."""
        return self._dumps

    def rearm(self) -> None:
        """Restart the countdown, dropping a stack taken without a stall to claim it."""
        if self._taken is not None:
            self._dumps += 1
            self._taken = None
        self._timer.arm()

    def pause(self) -> None:
        """Stop the countdown until the next `rearm` (the loop is idle)."""
        self._timer.disarm()

    def harvest(self) -> list[Frame] | None:
        """The loop thread's stack taken since the last re-arm, then re-arm.

        Called on the loop thread just after a stall.
        """
        self._timer.disarm()
        taken, self._taken = self._taken, None
        if taken is not None:
            self._dumps += 1
        self._timer.arm()
        return taken

    def close(self) -> None:
        global _owner
        self._timer.disarm()
        # An alarm raised just before the disarm must still find our handler: the default
        # action of SIGALRM ends the process.
        for _ in range(_PENDING_ALARM_YIELDS):
            if signal.SIGALRM not in signal.sigpending():
                break
            os.sched_yield()
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        self._timer.close()
        with _owner_lock:
            _owner = None

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        # Runs on the loop thread between two bytecodes: keep it short, and never raise.
        self._taken = own_stack(frame)
