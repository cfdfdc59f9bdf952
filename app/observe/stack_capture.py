"""The event-loop thread's Python stack, taken while the loop is stalled.

A watchdog written in Python cannot do this: while the loop sits in a C extension that holds
the GIL (`tokenizers.Tokenizer.encode`), no other Python thread runs until it returns.
faulthandler's C-level dump needs no GIL, so it shows the loop thread mid-stall, down to
the Python line that called into C.

How the dump is triggered: `faulthandler.register(SIGALRM, all_threads=False)` makes the
thread that receives SIGALRM write its own stack, and a thread-directed POSIX timer
(thread_timer.py) sends SIGALRM to the loop thread, never to another one. The timer is a
dead-man's switch: the loop monitor restarts it each time the loop starts a run of steps and
pauses it while the loop sleeps (loop_monitor.py); if one run of steps outlasts the timeout,
the loop is stalled and its thread dumps its stack while it still is.

Why only the receiving thread's own stack: with `all_threads=True` the handler walks the
frames of every other thread while they run, and CPython does not make that safe. Under
template renders in worker threads the process died with SIGSEGV within seconds (3 runs of
3; tests/test_stalls_stress.py drives that load). A thread reading its own frames from its
own signal handler is what faulthandler does on a fatal error, and it never crashed there.

Why a thread-directed timer and not `setitimer(ITIMER_REAL)`: its SIGALRM goes to the
process, which Linux delivers to the main thread only while that thread "wants" it; the loop
need not even run on the main thread. Why not block SIGALRM in every other thread instead:
threads created later (trio's thread cache, threads a Rust or C library starts) inherit
whatever mask their creator had. Why not `faulthandler.dump_traceback_later`: re-arming it
joins its watchdog thread and starts a new one, 80-180 µs a tick and up to 14 ms when the
cores are oversubscribed. Re-arm costs side by side: `python -m load bench detector-cost`.

The costs of a signal: the alarm interrupts whatever system call the loop thread is in
(Python retries them, PEP 475); it only fires during a stall. One capture per process holds
SIGALRM: `claim` returns the reason instead of a capture when another capture does, when
something else already uses SIGALRM (a Python handler or a running alarm, e.g.
pytest-timeout's signal method), or where no thread-directed timer exists. The monitor then
counts stalls without stacks.
"""

from __future__ import annotations

import faulthandler
import math
import os
import signal
import tempfile
import threading
import time

from app.observe.stalls import Frame, parse_own_stack
from app.observe.thread_timer import ThreadTimer

_owner_lock = threading.Lock()
_owner: LoopStackCapture | None = None
# A pending signal reaches a thread within microseconds; this only bounds a pathological mask.
_PENDING_ALARM_YIELDS = 1000


class LoopStackCapture:
    def __init__(self, timer: ThreadTimer, timeout_s: float) -> None:
        self._timer = timer
        self._timeout_s = timeout_s
        # The signal handler writes to a raw fd, so it must be a real file; open until close().
        self._file = tempfile.TemporaryFile()  # noqa: SIM115
        self._fd = self._file.fileno()
        # When the running countdown runs out, and when it was paused (inf: it runs).
        self._deadline = 0.0
        self._paused_at = math.inf
        self._dumps = 0

    @classmethod
    def claim(cls, timeout_s: float) -> LoopStackCapture | str:
        """Take SIGALRM for the calling thread (the loop's) and arm it, or say why not."""
        global _owner
        if not hasattr(signal, "SIGALRM"):
            return "this platform has no SIGALRM"
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
            _owner = capture = cls(timer, timeout_s)
        faulthandler.register(signal.SIGALRM, file=capture._fd, all_threads=False, chain=False)
        capture.rearm()
        return capture

    @property
    def dumps(self) -> int:
        """How many times the alarm fired and the loop thread dumped its stack."""
        return self._dumps

    def rearm(self) -> None:
        """Restart the countdown, dropping a dump that fired without a stall to claim it.

        Only a countdown that ran out can have written a dump, so the file is looked at
        only then: one system call instead of two, several hundred times a second.
        """
        now = time.monotonic()
        if min(now, self._paused_at) >= self._deadline and os.fstat(self._fd).st_size:
            self._dumps += 1
            self._truncate()
        self._start_countdown(now)

    def pause(self) -> None:
        """Stop the countdown until the next `rearm` (the loop is idle)."""
        self._timer.disarm()
        self._paused_at = time.monotonic()

    def harvest(self) -> list[Frame] | None:
        """The loop thread's stack from a dump taken since the last re-arm, then re-arm.

        Called on the loop thread just after a stall.
        """
        self._timer.disarm()
        size = os.fstat(self._fd).st_size
        dump = os.pread(self._fd, size, 0).decode("utf-8", "replace") if size else ""
        if dump:
            self._dumps += 1
            self._truncate()
        self._start_countdown(time.monotonic())
        return parse_own_stack(dump) if dump else None

    def close(self) -> None:
        global _owner
        self._timer.disarm()
        # An alarm raised just before the disarm must still find faulthandler's handler:
        # the default action of SIGALRM ends the process.
        for _ in range(_PENDING_ALARM_YIELDS):
            if signal.SIGALRM not in signal.sigpending():
                break
            os.sched_yield()
        faulthandler.unregister(signal.SIGALRM)
        self._timer.close()
        self._file.close()
        with _owner_lock:
            _owner = None

    def _start_countdown(self, now: float) -> None:
        self._timer.arm()
        self._deadline = now + self._timeout_s
        self._paused_at = math.inf

    def _truncate(self) -> None:
        os.ftruncate(self._fd, 0)
        # The handler writes at the fd's offset: without this the next dump lands past a hole.
        os.lseek(self._fd, 0, os.SEEK_SET)
