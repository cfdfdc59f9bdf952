"""Why the event loop stalled: its own work, the GIL, or the OS. Pure: samples in, label out.

Three causes, each with a different owner:
- `blocking`: the loop thread was busy, or asleep in a blocking call (`time.sleep`, a
  synchronous read): a bug in the task that ran.
- `gil-wait`: the loop thread was ready but another thread of ours held the GIL (a template
  render, or `Tokenizer.encode`, in a worker thread).
- `preempted`: the loop thread was runnable but the OS ran something else: not the task's.

Measured between two samples of the loop thread's clocks (thread_clocks.py): its CPU time,
its run delay (runnable on a run queue), its sleeps (voluntary context switches), the
process's CPU time and the other threads' run delay. Wall time that is neither CPU nor run
delay was a sleep, and a sleep was a GIL wait only as far as two bounds allow: other threads
of ours were active (on a CPU or runnable) that long, and n sleeps cover at most n switch
intervals (`take_gil` waits one at a time before it asks the holder to drop the GIL).

The label: a stall is the task's (`blocking`) when its own time, CPU plus sleeps that were
not GIL waits, reaches the threshold by itself, so it would have stalled an idle machine too.
Otherwise it goes to the larger outside cause, the GIL or the OS: a stall the OS caused is
never read as a bug in whatever task happened to run. A blocking call made while workers run
Python can hide behind their GIL hand-offs and read as `gil-wait`; tighter windows make that
rarer. The window may begin before the stall did (samples come at the probe's ticks and at
each stall's end): that earlier part (`unblamed_s`) is taken off the task's own time, so a
task is never blamed for time it did not take.
"""

from __future__ import annotations

from typing import NamedTuple

BLOCKING = "blocking"
GIL_WAIT = "gil-wait"
PREEMPTED = "preempted"
UNKNOWN = "unknown"  # the clocks are unavailable (see thread_clocks.py)

# A timed wait wakes up to the kernel's default timer slack (50 µs) after its deadline.
_WAKE_SLACK_S = 100e-6


class ThreadSample(NamedTuple):
    """One reading of the loop thread's clocks, in nanoseconds (and a count)."""

    wall_ns: int
    thread_cpu_ns: int
    run_delay_ns: int  # time spent runnable but not running
    sleeps: int  # voluntary context switches: times the thread went to sleep
    process_cpu_ns: int  # every thread of the process
    others_run_delay_ns: int  # the other threads' run delay, summed (see thread_clocks.py)


class CauseSplit(NamedTuple):
    """Where the loop thread's time in a stall went, in seconds."""

    blocking_s: float  # its own: on a CPU, or asleep in a call other than a GIL wait
    gil_wait_s: float
    preempted_s: float

    def to_json(self) -> dict[str, float]:
        return {BLOCKING: self.blocking_s, GIL_WAIT: self.gil_wait_s, PREEMPTED: self.preempted_s}


def split_window(
    start: ThreadSample, end: ThreadSample, *, unblamed_s: float, switch_interval_s: float
) -> CauseSplit:
    """Share out the wall time from `start` to `end` among the three causes.

    `unblamed_s`: how much of the window came before the stall (see the module docstring).
    `switch_interval_s`: `sys.getswitchinterval()`, or 0 when the interpreter has no GIL.
    """
    wall = max(0.0, (end.wall_ns - start.wall_ns) / 1e9)
    on_cpu = max(0.0, (end.thread_cpu_ns - start.thread_cpu_ns) / 1e9)
    preempted = min(wall, max(0.0, (end.run_delay_ns - start.run_delay_ns) / 1e9))
    asleep = max(0.0, wall - on_cpu - preempted)
    others_cpu = max(0.0, (end.process_cpu_ns - start.process_cpu_ns) / 1e9 - on_cpu)
    # A GIL holder starved of CPU holds the GIL for its run delay too, not just its CPU time.
    others_delayed = max(0.0, (end.others_run_delay_ns - start.others_run_delay_ns) / 1e9)
    others_active = others_cpu + others_delayed
    sleeps = max(0, end.sleeps - start.sleeps)
    gil_bound = sleeps * (switch_interval_s + _WAKE_SLACK_S) if switch_interval_s > 0 else 0.0
    gil_wait = min(asleep, others_active, gil_bound)
    own = max(0.0, on_cpu + asleep - gil_wait - unblamed_s)
    return CauseSplit(own, gil_wait, preempted)


def stall_cause(split: CauseSplit, threshold_s: float) -> str:
    """The label of a stall whose time went as `split` (see the module docstring)."""
    if split.blocking_s >= threshold_s:
        return BLOCKING
    if split.gil_wait_s == split.preempted_s == 0.0:
        return BLOCKING  # nothing outside the task took any of it
    return GIL_WAIT if split.gil_wait_s >= split.preempted_s else PREEMPTED
