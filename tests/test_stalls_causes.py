"""Stall causes as a pure function of two clock samples (app/observe/stall_causes.py).

Covers: a busy loop and `time.sleep` on the loop are `blocking`, with or without worker
threads running meanwhile; a thread holding the GIL is `gil-wait`, also when that thread is
itself starved of CPU; many short sleeps with no other thread active stay `blocking`; CPU
starvation is `preempted` unless the task's own time alone reaches the threshold; the part
of the window before the stall is not blamed on the task; no GIL, no `gil-wait`.

Samples are built by hand in milliseconds: no clock, no thread, no timing.
"""

from __future__ import annotations

import pytest

from app.observe.stall_causes import (
    BLOCKING,
    GIL_WAIT,
    PREEMPTED,
    CauseSplit,
    ThreadSample,
    split_window,
    stall_cause,
)

MS = 1_000_000
THRESHOLD_S = 0.010
SWITCH_INTERVAL_S = 0.005
START = ThreadSample(
    wall_ns=10_000 * MS,
    thread_cpu_ns=500 * MS,
    run_delay_ns=40 * MS,
    sleeps=1000,
    process_cpu_ns=2000 * MS,
    others_run_delay_ns=70 * MS,
)


def window(
    wall: float,
    cpu: float = 0.0,
    run_delay: float = 0.0,
    sleeps: int = 0,
    others_cpu: float = 0.0,
    others_run_delay: float = 0.0,
) -> ThreadSample:
    """The sample taken `wall` ms after START, the loop thread's deltas as given (ms)."""
    return ThreadSample(
        START.wall_ns + int(wall * MS),
        START.thread_cpu_ns + int(cpu * MS),
        START.run_delay_ns + int(run_delay * MS),
        START.sleeps + sleeps,
        START.process_cpu_ns + int((cpu + others_cpu) * MS),
        START.others_run_delay_ns + int(others_run_delay * MS),
    )


def classify(
    end: ThreadSample, unblamed_ms: float = 0.0, switch_interval_s: float = SWITCH_INTERVAL_S
) -> tuple[str, CauseSplit]:
    split = split_window(
        START, end, unblamed_s=unblamed_ms / 1000, switch_interval_s=switch_interval_s
    )
    return stall_cause(split, THRESHOLD_S), split


def test_busy_loop_on_the_loop_is_blocking() -> None:
    cause, split = classify(window(wall=50, cpu=50))
    assert cause == BLOCKING
    assert split == pytest.approx(CauseSplit(0.050, 0.0, 0.0))


def test_sleep_on_the_loop_is_blocking() -> None:
    assert classify(window(wall=50, cpu=0.2, sleeps=1))[0] == BLOCKING


def test_sleep_on_the_loop_while_a_worker_runs_python_is_still_blocking() -> None:
    # One long sleep plus a couple of GIL hand-offs when it ended: at most 3 switch
    # intervals of the 60 ms can have been GIL waits.
    cause, split = classify(window(wall=60, cpu=0.3, sleeps=3, others_cpu=60))
    assert cause == BLOCKING
    assert split.gil_wait_s <= 3 * 0.0052
    assert split.blocking_s > 0.040


def test_thread_holding_the_gil_is_gil_wait() -> None:
    # `encode` in a worker thread for ~100 ms: the loop wakes every switch interval to ask.
    cause, split = classify(window(wall=105, cpu=1, sleeps=21, others_cpu=104))
    assert cause == GIL_WAIT
    assert split.gil_wait_s == pytest.approx(0.104)
    assert split.blocking_s < THRESHOLD_S


def test_gil_holder_starved_of_cpu_is_still_gil_wait() -> None:
    # The holder computed 50 ms and waited 50 ms on a run queue, holding the GIL throughout.
    starved = window(wall=100, cpu=1, sleeps=20, others_cpu=50, others_run_delay=50)
    assert classify(starved)[0] == GIL_WAIT
    # Without the other threads' run delay the half it did not compute would look like the
    # loop's own sleep: what the run delay sum is for.
    unseen = window(wall=100, cpu=1, sleeps=20, others_cpu=50)
    assert classify(unseen)[0] == BLOCKING


def test_many_short_sleeps_with_no_other_thread_active_are_blocking() -> None:
    # Polling with time.sleep(0.001) on the loop: many wake-ups, but nobody held the GIL.
    assert classify(window(wall=50, cpu=1, sleeps=45))[0] == BLOCKING


def test_starvation_is_preempted_when_the_task_alone_would_not_have_stalled() -> None:
    cause, split = classify(window(wall=14, cpu=6, run_delay=8))
    assert cause == PREEMPTED
    assert split == pytest.approx(CauseSplit(0.006, 0.0, 0.008))


def test_task_that_stalls_by_itself_is_blocking_even_when_preempted_too() -> None:
    assert classify(window(wall=50, cpu=25, run_delay=25))[0] == BLOCKING


def test_gil_and_preemption_together_go_to_the_larger() -> None:
    assert classify(window(wall=30, cpu=1, run_delay=9, sleeps=6, others_cpu=20))[0] == GIL_WAIT
    assert classify(window(wall=30, cpu=1, run_delay=20, sleeps=2, others_cpu=9))[0] == PREEMPTED


def test_time_before_the_stall_is_not_blamed_on_the_task() -> None:
    # The probe's window: 8 ms of idle sleep, then a 12 ms stall spent 10 ms on a run queue.
    end = window(wall=20, cpu=2, run_delay=10, sleeps=1)
    assert classify(end)[0] == BLOCKING  # the idle 8 ms counted as the task's
    cause, split = classify(end, unblamed_ms=8)
    assert cause == PREEMPTED
    assert split.blocking_s == pytest.approx(0.002)
    assert classify(end, unblamed_ms=50)[1].blocking_s == 0.0


def test_without_a_gil_no_stall_is_gil_wait() -> None:
    cause, split = classify(window(wall=105, cpu=1, sleeps=21, others_cpu=104), switch_interval_s=0)
    assert (cause, split.gil_wait_s) == (BLOCKING, 0.0)


def test_a_stall_with_nothing_outside_the_task_is_blocking() -> None:
    assert stall_cause(CauseSplit(0.004, 0.0, 0.0), THRESHOLD_S) == BLOCKING


def test_split_is_json_keyed_by_cause() -> None:
    assert CauseSplit(0.001, 0.002, 0.003).to_json() == {
        "blocking": 0.001,
        "gil-wait": 0.002,
        "preempted": 0.003,
    }
