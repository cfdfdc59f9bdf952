"""A stall the OS caused reads `preempted`, end to end (app/observe/loop_monitor.py).

A child process pins itself to one CPU beside a CPU hog pinned to the same CPU, so the OS
runs its loop thread about half the time. Task steps that burn 60% of the stall threshold in
CPU time then take longer than the threshold in wall time: they are stalls the task alone
would not have caused, and must be labelled `preempted`, in the record and in the log line.
Steps that burn twice the threshold are the task's own doing and stay `blocking`, however
long the OS kept them waiting too. The two kinds of step are told apart by their phase.

The child runs the monitor in real time; the assertions are relative to its threshold.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from app.cli.rooms import RoomMetrics
from app.observe.loop_monitor import LoopMonitor

THRESHOLD_MS = 10.0
SHORT_STEPS = 40
LONG_STEPS = 8
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def burn_cpu(seconds: float) -> None:
    """Burn this thread's CPU time, however long the OS takes to give it."""
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        pass


class _Reports(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().splitlines()[0])


async def _steps_beside_a_hog() -> dict[str, Any]:
    threshold_s = THRESHOLD_MS / 1000
    monitor = LoopMonitor(
        RoomMetrics.create().loop, THRESHOLD_MS, instrument=True, reports_per_minute=1000
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.run)
        for phase, steps, cpu_s in (
            ("short", SHORT_STEPS, 0.6 * threshold_s),
            ("long", LONG_STEPS, 2 * threshold_s),
        ):
            for _ in range(steps):
                with monitor.phase(phase):
                    burn_cpu(cpu_s)
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    mine = trio.lowlevel.current_task().name
    causes: dict[str, Counter[str]] = {"short": Counter(), "long": Counter()}
    for record in monitor.snapshot()["recent"]:
        if record["task"] == mine and record["phase"] in causes:
            causes[record["phase"]][record["cause"]] += record["count"]
    return {phase: dict(counts) for phase, counts in causes.items()}


def child_main() -> None:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    reports = _Reports()
    logging.getLogger("sluice.stalls").addHandler(reports)
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(cpu)])
    try:
        time.sleep(0.2)  # let the hog reach its CPU before the first step
        result = trio.run(_steps_beside_a_hog)
    finally:
        hog.kill()
        hog.wait()
    result["preempted_reports"] = [line for line in reports.lines if "(preempted" in line]
    print(json.dumps(result))


def test_steps_slowed_by_a_cpu_hog_are_preempted_and_own_stalls_stay_blocking() -> None:
    child = subprocess.run(
        [sys.executable, "-m", "tests.test_stalls_preempted"],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)

    short, long = result["short"], result["long"]
    assert sum(short.values()) >= SHORT_STEPS / 4, result  # the hog did slow most steps
    assert set(short) == {"preempted"}, result
    assert set(long) == {"blocking"}, result
    assert sum(long.values()) == LONG_STEPS, result
    report = result["preempted_reports"][0]
    assert "(preempted: the OS ran other work for" in report
    assert "during task" in report
    assert " in task" not in report


if __name__ == "__main__":
    child_main()
