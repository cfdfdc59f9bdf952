"""The event-loop thread's Python stack, taken while the loop is stalled.

A watchdog written in Python cannot do this: while the loop sits in a C extension that holds
the GIL, no other Python thread runs until it returns, and one that runs Python code cannot
walk another thread's frames safely. So the loop thread takes its own stack, at the first
moment it can: a thread-directed POSIX timer (thread_timer.py) sends SIGALRM to the loop
thread, and Python runs our SIGALRM handler on that thread between two bytecodes, handing it
the frame it interrupted. In a stall made of Python code (a render on the loop, a busy loop)
that is the stall's own frame, within microseconds; in one made of a single C call that
holds the GIL (`json.loads` of a large body), it is the frame that made the call, as soon
as the call returns, still inside the stalled step. The timer is a dead-man's switch: the
loop monitor restarts it each time the loop starts a run of steps and pauses it while the
loop sleeps (loop_monitor.py); if one run of steps outlasts the timeout, the loop is stalled.

Why not faulthandler, which dumps a stack from the C signal handler itself, even in the
middle of a C call: it reads the interpreter's frames at an arbitrary instruction, and
CPython does not keep them consistent at every instruction. With `all_threads=True` (every
thread's frames) the proxy died with SIGSEGV within seconds under template renders in worker
threads; with `all_threads=False` (the receiving thread's own) it died too, rarely: 4 times
in about a day of benchmarks on 2026-11-25/26, each right after a stall report, each with
faulthandler's fatal-error traceback missing, which is what its guard against re-entering a
dump in progress does. A stack read by Python code between bytecodes is always consistent.
The price: a loop that never comes back from a C call is never captured, and a Python
handler needs the main thread (where `sluice serve` runs its loop).

Why a thread-directed timer and not `setitimer(ITIMER_REAL)`: its SIGALRM goes to the
process, which Linux delivers to the main thread only while that thread "wants" it, and a
system call the loop thread is blocked in (a stall in `time.sleep`) is interrupted only by a
signal delivered to it (Python retries the call after running the handler, PEP 475).

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
