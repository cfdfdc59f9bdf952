"""The event-loop thread's Python stack, taken while the loop is stalled.

A watchdog written in Python cannot do this: while the loop sits in a C extension that holds
the GIL (`tokenizers.Tokenizer.encode`), no other Python thread runs until it returns.
faulthandler's C-level dump needs no GIL, so it shows the loop thread mid-stall, down to
the Python line that called into C.

How the dump is triggered: `faulthandler.register(SIGALRM)` makes SIGALRM dump every
thread's stack from the signal handler, and `signal.setitimer(ITIMER_REAL, timeout_s)` is a
dead-man's switch that the caller re-arms from a periodic probe. If the probe runs late by
`timeout_s`, the loop is stalled and the alarm dumps the stacks while it still is.

Why not `faulthandler.dump_traceback_later`, which also dumps from C: re-arming it joins
its watchdog thread and starts a new one. Measured here at one re-arm per 5 ms: 80-115 µs
a re-arm (1.6-2.3% of the loop's time) against 9 µs for `setitimer`
(load/bench_stall_detector.py); and with the two cores oversubscribed the join waited up
to 14 ms for the old thread to be scheduled, so the detector stalled the loop it watches.
`setitimer` is one system call with no thread hand-off.

The costs of a signal: SIGALRM and ITIMER_REAL are process-wide, and the alarm interrupts
whatever system call the receiving thread is in (Python retries them, PEP 475); it only
fires during a stall. One capture per process holds them: `claim` returns None when
another capture does, or when something else already uses SIGALRM (a Python handler or a
running alarm, e.g. pytest-timeout's signal method), and on platforms without
`setitimer`. The monitor then counts stalls without stacks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import threading
import time

from app.observe.stalls import Frame, parse_thread_stack

_owner_lock = threading.Lock()
_owner: LoopStackCapture | None = None
# A pending signal reaches a thread within microseconds; this only bounds a pathological mask.
_PENDING_ALARM_YIELDS = 1000


class LoopStackCapture:
    def __init__(self, loop_thread_id: int, timeout_s: float) -> None:
        self._loop_thread_id = loop_thread_id
        self._timeout_s = timeout_s
        # The signal handler writes to a raw fd, so it must be a real file; open until close().
        self._file = tempfile.TemporaryFile()  # noqa: SIM115
        self._fd = self._file.fileno()
        self._armed_at = 0.0

    @classmethod
    def claim(cls, loop_thread_id: int, timeout_s: float) -> LoopStackCapture | str:
        """Take SIGALRM and arm it, or say why the stacks are unavailable."""
        global _owner
        if not hasattr(signal, "setitimer"):
            return "this platform has no setitimer"
        with _owner_lock:
            if _owner is not None:
                return "another monitor in this process owns SIGALRM"
            if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None) or any(
                signal.getitimer(signal.ITIMER_REAL)
            ):
                return "SIGALRM is already in use in this process"
            _owner = capture = cls(loop_thread_id, timeout_s)
        faulthandler.register(signal.SIGALRM, file=capture._fd, all_threads=True, chain=False)
        capture.rearm()
        return capture

    def rearm(self) -> None:
        """Restart the countdown, dropping a dump that fired without a stall to claim it.

        Only a countdown that ran out can have written a dump, so the file is looked at
        only then: one system call a tick instead of two (the probe ticks every 5 ms).
        """
        now = time.monotonic()
        if now - self._armed_at >= self._timeout_s and os.fstat(self._fd).st_size:
            self._truncate()
        signal.setitimer(signal.ITIMER_REAL, self._timeout_s)
        self._armed_at = now

    def harvest(self) -> list[Frame] | None:
        """The loop thread's stack from a dump taken since the last re-arm, then re-arm.

        Called on the loop thread just after a stall.
        """
        signal.setitimer(signal.ITIMER_REAL, 0)
        size = os.fstat(self._fd).st_size
        dump = os.pread(self._fd, size, 0).decode("utf-8", "replace") if size else ""
        self.rearm()
        return parse_thread_stack(dump, self._loop_thread_id) if dump else None

    def close(self) -> None:
        global _owner
        signal.setitimer(signal.ITIMER_REAL, 0)
        # An alarm raised just before the disarm must still find faulthandler's handler:
        # the default action of SIGALRM ends the process.
        for _ in range(_PENDING_ALARM_YIELDS):
            if signal.SIGALRM not in signal.sigpending():
                break
            os.sched_yield()
        faulthandler.unregister(signal.SIGALRM)
        self._file.close()
        with _owner_lock:
            _owner = None

    def _truncate(self) -> None:
        os.ftruncate(self._fd, 0)
        # The handler writes at the fd's offset: without this the next dump lands past a hole.
        os.lseek(self._fd, 0, os.SEEK_SET)
