"""The loop thread's clocks, read cheaply enough to sample on every probe tick.

A light sample (`ThreadClocks.sample`, ~4 µs) is five readings:
- wall time (`time.perf_counter_ns`);
- the loop thread's CPU time (`time.thread_time_ns`: exact, where schedstat's CPU field and
  getrusage's lag by up to a scheduler tick for a running thread);
- its run delay, ns spent runnable on a run queue: the second field of
  `/proc/thread-self/schedstat`, kept open and re-read with `os.pread` (kept by every kernel
  built with CONFIG_SCHED_INFO, as mainstream distributions' are);
- its voluntary context switches, how many times it went to sleep (`getrusage(RUSAGE_THREAD)`);
- the process's CPU time, all threads (`time.process_time_ns`).

A full sample (`sample(full=True)`: at the end of a stall, and from the probe every 25 ms)
also sums the other threads' run delay, one `pread` each: a GIL holder starved of CPU keeps
the GIL while it waits, and without its run delay that wait would look like the loop
thread's own sleep. The thread list is read again when the number of Python threads
changed, and once a second for others; a thread found later counts from its start. Light
samples carry the last full sum: a looser bound over a window, never a missing one. At most
MAX_OTHER_THREADS are watched.

The files are opened by the thread they describe and `sample` runs on it (`thread_time_ns`
reads the caller's clock). Elsewhere than Linux, `open` returns the reason instead, and
stalls are labelled `unknown`.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time

from app.observe.stall_causes import ThreadSample

SCHEDSTAT = "/proc/thread-self/schedstat"
TASKS = "/proc/self/task"
THREAD_LIST_REFRESH_S = 1.0
# One pread each per full sample: past this many threads the rest go unwatched (their run
# delay unseen, so a GIL wait behind them may read as the loop's own sleep).
MAX_OTHER_THREADS = 64


class ThreadClocks:
    def __init__(self, fd: int, native_id: int) -> None:
        self._fd = fd
        self._native_id = native_id
        # Other threads: tid -> (fd, run delay when first seen or last read).
        self._others: dict[int, tuple[int, int]] = {}
        # Their run delay since monitoring began, exited threads included: a monotonic sum.
        self._others_run_delay_ns = 0
        self._listed_at = -THREAD_LIST_REFRESH_S
        self._python_threads = 0
        self._listed_before = False

    @classmethod
    def open(cls) -> ThreadClocks | str:
        """The calling thread's clocks, or why they cannot be read."""
        if not sys.platform.startswith("linux"):
            return f"run delays need Linux's schedstat (this is {sys.platform})"
        try:
            fd = os.open(SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return f"cannot open {SCHEDSTAT}: {exc.strerror}"
        clocks = cls(fd, threading.get_native_id())
        try:
            clocks.sample(full=True)
        except (OSError, ValueError, IndexError) as exc:
            clocks.close()
            return f"cannot read {SCHEDSTAT}: {exc}"
        return clocks

    def sample(self, *, full: bool = False) -> ThreadSample:
        fields = os.pread(self._fd, 128, 0).split()
        if full:
            self._read_others()
        return ThreadSample(
            time.perf_counter_ns(),
            time.thread_time_ns(),
            int(fields[1]),
            resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw,
            time.process_time_ns(),
            self._others_run_delay_ns,
        )

    def close(self) -> None:
        os.close(self._fd)
        for fd, _ in self._others.values():
            os.close(fd)
        self._others.clear()

    def _read_others(self) -> None:
        now = time.monotonic()
        python_threads = threading.active_count()
        if python_threads != self._python_threads or now - self._listed_at >= THREAD_LIST_REFRESH_S:
            self._listed_at = now
            self._python_threads = python_threads
            self._list_threads()
        gone = []
        for tid, (fd, last) in self._others.items():
            try:
                delay = int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):
                gone.append(tid)  # exited: what it accrued until the last read is kept
                continue
            self._others_run_delay_ns += max(0, delay - last)
            self._others[tid] = (fd, delay)
        for tid in gone:
            os.close(self._others.pop(tid)[0])

    def _list_threads(self) -> None:
        try:
            tids = {int(name) for name in os.listdir(TASKS)} - {self._native_id}
        except OSError:
            return
        for tid in sorted(tids - self._others.keys())[: MAX_OTHER_THREADS - len(self._others)]:
            try:
                fd = os.open(f"{TASKS}/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # exited since the listing
            try:
                delay = int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):
                os.close(fd)
                continue
            self._others[tid] = (fd, 0 if self._listed_before else delay)
        self._listed_before = True
