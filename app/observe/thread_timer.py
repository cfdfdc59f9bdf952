"""A one-shot timer whose signal goes to one chosen thread: Linux POSIX timers via ctypes.

`signal.setitimer` cannot do this: ITIMER_REAL's SIGALRM is directed at the process, and
Linux hands a process-directed signal to the thread-group leader only if that thread
"wants" it (not blocked, and running or without a signal already pending), otherwise to
any other thread. The stall detector needs the alarm on the event-loop thread every time,
because that thread takes its own stack in the signal's handler (see stack_capture.py).

`timer_create(CLOCK_MONOTONIC, SIGEV_THREAD_ID)` names the receiving thread by its kernel
thread id, and `timer_settime` re-arms the countdown. Both come from glibc (libc since
2.34, librt before) and musl; other platforms return the reason instead of a timer.

The calls go through `ctypes.PyDLL`, which keeps the GIL: `CDLL` would release it around
each re-arm and hand it to any worker thread waiting for it, so the loop would queue for
the GIL behind a template render on every probe tick.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable

CLOCK_MONOTONIC = 1
SIGEV_THREAD_ID = 4  # Linux: notify the thread named in sigev_notify_thread_id
_SIGEVENT_SIZE = 64  # glibc's and musl's __SIGEV_MAX_SIZE on every Linux architecture


class _SigEvent(ctypes.Structure):
    _fields_ = [
        ("sigev_value", ctypes.c_void_p),  # union sigval: pointer-sized
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("sigev_notify_thread_id", ctypes.c_int),  # first member of the _sigev_un union
        ("_pad", ctypes.c_byte * (_SIGEVENT_SIZE - ctypes.sizeof(ctypes.c_void_p) - 12)),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _library_with_timers() -> str | None:
    """The name to load timer_create from: None for the C library already loaded (glibc
    2.34+, musl), else librt. OSError when neither has it."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"thread-directed timers need Linux (this is {sys.platform})")
    for name in (None, ctypes.util.find_library("rt")):
        try:
            lib = ctypes.PyDLL(name)
        except OSError:
            continue
        if hasattr(lib, "timer_create") and hasattr(lib, "timer_settime"):
            return name
    raise OSError("the C library has no timer_create")


class ThreadTimer:
    """Sends `signum` to thread `native_id` once `timeout_s` after each `arm()`.

    `arm()` restarts the countdown (a running one is replaced); `disarm()` stops it.
    """

    def __init__(self, library: str | None, timer_id: int, timeout_s: float) -> None:
        self._library = library
        self._timer_id = timer_id
        seconds, fraction = divmod(timeout_s, 1.0)
        self._armed = _ITimerSpec(it_value=_Timespec(int(seconds), int(fraction * 1e9)))
        self._disarmed = _ITimerSpec()
        # The re-arm runs on every probe tick, so it is trimmed to the bone (about 10 µs
        # less a call, `python -m load bench detector-cost`): a handle without `use_errno` (ctypes
        # would swap errno through a thread-local on each call; timer_settime cannot fail
        # on a live timer with a valid spec), raw addresses for arguments, and `arm` bound
        # once as a partial rather than a method that looks them up.
        settime = ctypes.PyDLL(library).timer_settime
        settime.argtypes = [ctypes.c_void_p] * 4
        settime.restype = ctypes.c_int
        self.arm: Callable[[], int] = functools.partial(
            settime, timer_id, 0, ctypes.addressof(self._armed), None
        )
        self.disarm: Callable[[], int] = functools.partial(
            settime, timer_id, 0, ctypes.addressof(self._disarmed), None
        )

    @classmethod
    def create(cls, native_id: int, signum: int, timeout_s: float) -> ThreadTimer | str:
        """A disarmed timer for thread `native_id` (`threading.get_native_id()`), or why not."""
        try:
            library = _library_with_timers()
        except OSError as exc:
            return str(exc)
        create = ctypes.PyDLL(library, use_errno=True).timer_create
        create.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_SigEvent),
            ctypes.POINTER(ctypes.c_void_p),
        ]
        create.restype = ctypes.c_int
        event = _SigEvent(
            sigev_signo=signum, sigev_notify=SIGEV_THREAD_ID, sigev_notify_thread_id=native_id
        )
        timer_id = ctypes.c_void_p()
        if create(CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer_id)) != 0:
            return f"timer_create failed: {os.strerror(ctypes.get_errno())}"
        return cls(library, timer_id.value or 0, timeout_s)

    def close(self) -> None:
        delete = ctypes.PyDLL(self._library).timer_delete
        delete.argtypes = [ctypes.c_void_p]
        delete(self._timer_id)
