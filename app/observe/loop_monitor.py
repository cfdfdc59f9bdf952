"""Watching the Trio event loop: how late it wakes, which task steps stall it, where, and why.

`LoopMonitor.run` goes in the main nursery and does four things:
- a lag probe sleeps and records how late it woke (`sluice_event_loop_lag_seconds`): the
  delay any request feels. It ticks every `probe_interval_s` while another of our threads
  is on a CPU (only the probe sees the loop wait for the GIL between steps), every
  QUIET_PROBE_INTERVAL_S while the loop thread works alone, and every IDLE_PROBE_INTERVAL_S
  while nothing runs.
- an instrument times every task step; a step longer than the threshold is a stall: counted
  per task and cause, tied to the request phase (`phase`) and to the stack `stack_capture`
  took if its alarm fired inside the step. The instrument starts the alarm's countdown when
  the loop comes back from waiting for I/O and pauses it when the loop sleeps, so the alarm
  fires only when one run of steps outlasts the threshold (instrument off: the probe re-arms
  it at every tick).
- each stall gets a cause (stall_causes.py) from the loop thread's clocks (thread_clocks.py),
  sampled at the probe's ticks and when the stall ends, not after I/O waits: a relaying
  proxy waits for I/O once per token.
- stalls go into a ring of recent distinct stalls, a few a minute to the "sluice.stalls"
  logger, and their seconds are summed by stage (`stall_stage`: the innermost frame of
  Sluice's code on the stall's stack, else its phase) and cause, read off /metrics.

The probe also records stalls no step explains, with task `(unknown)`: with the instrument
off, every wake-up later than the threshold; with it on, a late wake-up whose cause is the
GIL or the OS (the loop waiting for the GIL as it returns from its I/O wait, which is how a
worker thread's `encode` or render freezes the loop). Many short steps are load, not stalls.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import TypedDict

import trio
from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import Metric

from app.observe.metrics import LoopMetrics
from app.observe.rate_limit import RateLimiter
from app.observe.stack_capture import LoopStackCapture
from app.observe.stall_causes import (
    BLOCKING,
    UNKNOWN,
    CauseSplit,
    ThreadSample,
    split_window,
    stall_cause,
)
from app.observe.stalls import (
    BoundedLabels,
    Frame,
    HistogramSummary,
    RecentMax,
    StallRecord,
    StallRing,
    format_stall_report,
    frames_of_task,
    stall_stage,
    summarize_histogram,
)
from app.observe.thread_clocks import ThreadClocks

log = logging.getLogger("sluice.stalls")


class LagSummary(HistogramSummary):
    max_recent: float  # the worst probe of the last `max_recent_window_s`
    max_recent_window_s: float


class StallSummary(HistogramSummary):
    by_task: dict[str, float]
    by_cause: dict[str, float]


class LoopSnapshot(TypedDict):
    """The `loop` block of the dashboard's snapshot."""

    threshold_ms: float
    probe_interval_ms: float
    instrument: bool
    stacks: bool
    stacks_off_reason: str | None
    stack_dumps: int
    causes: bool
    causes_off_reason: str | None
    lag: LagSummary
    stalls: StallSummary
    recent: list[StallRecord]  # newest first


PROBE_INTERVAL_S = 0.005
# A tick costs ~0.15 ms of CPU here, mostly the wake-up itself: at 5 ms while requests
# trickle in, the probe alone was 0.3-0.5 ms of CPU per request at 100 requests/s.
QUIET_PROBE_INTERVAL_S = 0.025
# While the loop is idle (no task but the probe stepped for IDLE_AFTER_S), the probe ticks
# at this pace instead, and the loop's next wake-up for other work wakes it.
IDLE_PROBE_INTERVAL_S = 1.0
IDLE_AFTER_S = 0.005
# Other threads' CPU between two ticks below which the process counts as idle (a worker
# thread holding the GIL would stall the loop without any task step of its own).
OTHERS_IDLE_CPU_NS = 1_000_000
RECENT_LAG_WINDOW_S = 10.0
# The other threads' run delays (a pread each) are read at the end of every stall, and in
# between at this pace: ~13 µs with 6 threads, too much for every 5 ms tick.
FULL_SAMPLE_EVERY_S = 0.025
# The task label of stalls the probe found outside any timed step.
UNKNOWN_TASK = "(unknown)"
# Sluice's own code, whose innermost frame on a stall's stack names the stall's stage.
APP_DIR = str(Path(__file__).parent.parent)  # as co_filename spells it: not resolved


class _StepTimer(trio.abc.Instrument):
    """Times task steps with one hook per step instead of two (before/after).

    A step starts where the previous one ended, or where the loop came back from waiting
    for I/O, so `after_task_step` alone can time it: the instrument's cost halves (see
    `python -m load bench detector-cost`) and the only thing billed to a step besides its own code
    is Trio's bookkeeping between steps (deadline expiry for the batch's first step).
    """

    def __init__(self, monitor: LoopMonitor, threshold_s: float) -> None:
        self._monitor = monitor
        self._threshold_s = threshold_s
        # Start of the current step; phases that end after it belong to it. When the
        # instrument is off the probe moves it on each tick instead.
        self.window_started = perf_counter()
        # The latest sample of the loop thread's clocks (None without clocks): a stall's
        # cause is read over the window from it to the stall's end.
        self.mark: ThreadSample | None = None
        self.capture: LoopStackCapture | None = None  # the stack alarm, counting while busy
        # The probe's task; when the last step of any other task ended (whether the loop is
        # idle); set while the probe idles, to wake it when the loop wakes for other work.
        self.probe: trio.lowlevel.Task | None = None
        self.worked_at = 0.0
        self.idle_wake: trio.Event | None = None
        self.woke_at = 0.0

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0 and self.capture is not None:
            self.capture.pause()

    def after_io_wait(self, timeout: float) -> None:
        if self.capture is not None:
            self.capture.rearm()
        now = self.window_started = perf_counter()
        if self.idle_wake is not None:
            self.woke_at = now
            self.idle_wake.set()
            self.idle_wake = None

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        ended = perf_counter()
        elapsed = ended - self.window_started
        if elapsed > self._threshold_s:
            self._monitor._on_step_stall(task, elapsed)
            # Harvesting the stack takes time too; it is not the next step's.
            ended = perf_counter()
        self.window_started = ended
        if task is not self.probe:
            self.worked_at = ended


def _others_cpu_ns(sample: ThreadSample) -> int:
    return sample.process_cpu_ns - sample.thread_cpu_ns


class _Phase:
    __slots__ = ("_monitor", "_name", "_started")

    def __init__(self, monitor: LoopMonitor, name: str) -> None:
        self._monitor = monitor
        self._name = name
        self._started = 0.0

    def __enter__(self) -> None:
        self._started = perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._monitor._end_phase(self._name, self._started)


class LoopMonitor:
    def __init__(
        self,
        metrics: LoopMetrics,
        threshold_ms: float,
        instrument: bool,
        *,
        probe_interval_s: float = PROBE_INTERVAL_S,
        ring_size: int = 32,
        max_task_labels: int = 50,
        reports_per_minute: int = 5,
    ) -> None:
        self._metrics = metrics
        self._threshold_s = threshold_ms / 1000
        self._instrument_enabled = instrument
        self._probe_interval_s = probe_interval_s
        self._step_timer = _StepTimer(self, self._threshold_s)
        self._ring = StallRing(ring_size)
        self._task_labels = BoundedLabels(max_task_labels)
        self._stage_labels = BoundedLabels(max_task_labels)
        self._report_limiter = RateLimiter(reports_per_minute, 60.0)
        self._recent_lag = RecentMax(RECENT_LAG_WINDOW_S)
        self._capture: LoopStackCapture | None = None
        self._stacks_off_reason: str | None = None
        self._clocks: ThreadClocks | None = None
        self._causes_off_reason: str | None = None
        self._loop_thread_id: int | None = None
        self._step_stalls = 0  # stalled steps so far: tells the probe which lag they explain
        # The longest phase that ended in the current window (see _StepTimer.window_started).
        self._phase_name: str | None = None
        self._phase_longest = 0.0
        self._phase_ended = 0.0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._loop_thread_id = threading.get_ident()
        # The instrument restarts the countdown when a run of steps starts; the probe only
        # at its ticks, so the countdown then allows for one interval more.
        timeout_s = self._threshold_s + (0 if self._instrument_enabled else self._probe_interval_s)
        claimed = LoopStackCapture.claim(timeout_s)
        if isinstance(claimed, str):
            self._stacks_off_reason = claimed
            log.warning(
                "stall stacks are off for this monitor (%s); stalls are still counted", claimed
            )
        else:
            self._capture = claimed
        clocks = ThreadClocks.open()
        if isinstance(clocks, str):
            self._causes_off_reason = clocks
            log.warning("stall causes are off for this monitor (%s)", clocks)
        else:
            self._clocks = clocks
            self._step_timer.mark = clocks.sample(full=True)
        if self._instrument_enabled:
            self._step_timer.window_started = perf_counter()
            self._step_timer.capture = self._capture
            trio.lowlevel.add_instrument(self._step_timer)
        try:
            task_status.started()
            await self._probe()
        finally:
            if self._instrument_enabled:
                # Trio has already dropped an instrument whose hook raised.
                with contextlib.suppress(KeyError):
                    trio.lowlevel.remove_instrument(self._step_timer)
                self._step_timer.probe = self._step_timer.idle_wake = None
            if self._capture is not None:
                self._capture.close()
                self._capture = self._step_timer.capture = None
            if self._clocks is not None:
                self._clocks.close()
                self._clocks = self._step_timer.mark = None
            self._stacks_off_reason = self._causes_off_reason = None
            self._loop_thread_id = None

    def phase(self, name: str) -> _Phase:
        """`with monitor.phase("tokenize-inline"): ...` tags stalls inside with that phase.

        For synchronous code on the loop thread; used elsewhere it has no effect.
        """
        return _Phase(self, name)

    def snapshot(self) -> LoopSnapshot:
        """Everything the dashboard shows about the loop, JSON-serialisable."""
        lag: LagSummary = {
            **_summarize(self._metrics.loop_lag_seconds),
            "max_recent": self._recent_lag.value(perf_counter()),
            "max_recent_window_s": RECENT_LAG_WINDOW_S,
        }
        stalls: StallSummary = {
            **_summarize(self._metrics.loop_stall_seconds),
            "by_task": _counts_by_label(self._metrics.loop_stalls, "task"),
            "by_cause": _counts_by_label(self._metrics.loop_stalls, "cause"),
        }
        return {
            "threshold_ms": self._threshold_s * 1000,
            "probe_interval_ms": self._probe_interval_s * 1000,
            "instrument": self._instrument_enabled,
            "stacks": self._capture is not None,
            "stacks_off_reason": self._stacks_off_reason,
            "stack_dumps": self._capture.dumps if self._capture is not None else 0,
            "causes": self._clocks is not None,
            "causes_off_reason": self._causes_off_reason,
            "lag": lag,
            "stalls": stalls,
            "recent": self._ring.recent(),
        }

    async def _probe(self) -> None:
        timer = self._step_timer
        clocks = self._clocks
        previous = timer.mark
        explained = self._step_stalls
        full_at = perf_counter()
        timer.probe = trio.lowlevel.current_task()
        others_busy = True
        while True:
            # Idle (no other task stepped for IDLE_AFTER_S, and no other thread of ours was on
            # a CPU), the probe sleeps longer, and the loop's next wake-up for other work wakes
            # it with no wake-up of its own: an idle proxy then costs ~4 ms of CPU a second, not
            # ~20 (each wake-up costs ~0.4 ms here), and requests that trickle in cost a tick
            # each, not several.
            quiet = self._instrument_enabled and not others_busy
            idle = quiet and perf_counter() - timer.worked_at > IDLE_AFTER_S
            if idle:
                interval = IDLE_PROBE_INTERVAL_S
            elif quiet:
                interval = max(self._probe_interval_s, QUIET_PROBE_INTERVAL_S)
            else:
                interval = self._probe_interval_s
            due = perf_counter() + interval
            if idle:
                due = await self._idle_wait(due)
            else:
                await trio.sleep(interval)
            woke = perf_counter()
            lag = max(0.0, woke - due)
            sample = None
            if clocks is not None:
                full = lag > self._threshold_s or woke - full_at >= FULL_SAMPLE_EVERY_S
                sample = clocks.sample(full=full)
                full_at = woke if full else full_at
                others_busy = previous is None or (
                    _others_cpu_ns(sample) - _others_cpu_ns(previous) > OTHERS_IDLE_CPU_NS
                )
            else:
                others_busy = False  # no clocks: task steps alone tell idleness
            self._metrics.loop_lag_seconds.observe(lag)
            self._recent_lag.add(woke, lag)
            recorded = False
            if lag > self._threshold_s and (
                not self._instrument_enabled or self._step_stalls == explained
            ):
                cause, split = self._cause(previous, sample, lag)
                # With the instrument on, a late wake-up of the loop's own making is load:
                # the steps that made it were each timed, and none was a stall.
                if not self._instrument_enabled or cause not in (BLOCKING, UNKNOWN):
                    self._count_stall(UNKNOWN_TASK, cause, lag)
                    self._record_stall(None, lag, self._harvest_stack(), cause, split)
                    recorded = True
            if not recorded and self._capture is not None and not self._instrument_enabled:
                self._capture.rearm()
            if sample is not None:
                previous = timer.mark = sample
            explained = self._step_stalls
            if recorded or not self._instrument_enabled:
                # The stall just recorded may have begun inside this very step (the loop
                # waiting for the GIL after its I/O wait): the instrument must not time it
                # again as the probe's own stall.
                timer.window_started = perf_counter()

    async def _idle_wait(self, due: float) -> float:
        """Sleep until `due` (perf_counter) unless the loop wakes for other work first; return
        when the probe was due to run again, from which its lag counts."""
        timer = self._step_timer
        work = timer.idle_wake = trio.Event()
        with trio.move_on_after(due - perf_counter()):
            await work.wait()
        timer.idle_wake = None
        return timer.woke_at if work.is_set() else due

    def _on_step_stall(self, task: trio.lowlevel.Task, duration_s: float) -> None:
        self._step_stalls += 1
        timer = self._step_timer
        end = self._clocks.sample(full=True) if self._clocks is not None else None
        cause, split = self._cause(timer.mark, end, duration_s)
        if end is not None:
            timer.mark = end
        self._count_stall(self._task_labels.label(task.name), cause, duration_s)
        frames = self._harvest_stack()
        root = getattr(task.coro, "cr_code", None)
        if frames is not None and root is not None:
            frames = frames_of_task(frames, root.co_filename, root.co_name)
        self._record_stall(task.name, duration_s, frames, cause, split)

    def _cause(
        self, start: ThreadSample | None, end: ThreadSample | None, stall_s: float
    ) -> tuple[str, CauseSplit | None]:
        """The cause of a stall of `stall_s` that ended at `end`, over the window from `start`."""
        if start is None or end is None:
            return UNKNOWN, None
        gil = getattr(sys, "_is_gil_enabled", lambda: True)()
        split = split_window(
            start,
            end,
            unblamed_s=max(0.0, (end.wall_ns - start.wall_ns) / 1e9 - stall_s),
            switch_interval_s=sys.getswitchinterval() if gil else 0.0,
        )
        return stall_cause(split, self._threshold_s), split

    def _count_stall(self, task_label: str, cause: str, duration_s: float) -> None:
        self._metrics.loop_stalls.labels(task=task_label, cause=cause).inc()
        self._metrics.loop_stall_seconds.observe(duration_s)

    def _harvest_stack(self) -> list[Frame] | None:
        return self._capture.harvest() if self._capture is not None else None

    def _record_stall(
        self,
        task: str | None,
        duration_s: float,
        frames: list[Frame] | None,
        cause: str,
        split: CauseSplit | None,
    ) -> None:
        phase = self._current_phase()
        stage = self._stage_labels.label(stall_stage(frames, phase, APP_DIR))
        self._metrics.loop_stall_stage_seconds.labels(stage, cause).observe(duration_s)
        record = self._ring.add(
            time=time.time(),
            duration_s=duration_s,
            task=task,
            phase=phase,
            stack=[str(frame) for frame in frames or ()],
            cause=cause,
            split=split.to_json() if split is not None else None,
        )
        suppressed = self._report_limiter.admit(time.monotonic())
        if suppressed is not None:
            log.warning("%s", format_stall_report(record, duration_s, suppressed))

    def _end_phase(self, name: str, started: float) -> None:
        if threading.get_ident() != self._loop_thread_id:
            return
        ended = perf_counter()
        if self._phase_ended < self._step_timer.window_started or (
            ended - started > self._phase_longest
        ):
            self._phase_name = name
            self._phase_longest = ended - started
        self._phase_ended = ended

    def _current_phase(self) -> str | None:
        in_window = self._phase_ended >= self._step_timer.window_started
        return self._phase_name if in_window else None


def _summarize(histogram: Histogram) -> HistogramSummary:
    bounds: list[float] = []
    cumulative: list[float] = []
    total = 0.0
    for sample in _only_metric(histogram).samples:
        if sample.name.endswith("_bucket"):
            if sample.labels["le"] != "+Inf":
                bounds.append(float(sample.labels["le"]))
            cumulative.append(sample.value)
        elif sample.name.endswith("_sum"):
            total = sample.value
    return summarize_histogram(bounds, cumulative, total)


def _only_metric(collector: Histogram | Counter) -> Metric:
    return next(iter(collector.collect()))


def _counts_by_label(counter: Counter, label: str) -> dict[str, float]:
    """The counter's total per value of `label`, summed over its other labels."""
    counts: dict[str, float] = {}
    for sample in _only_metric(counter).samples:
        if sample.name.endswith("_total"):
            value = sample.labels[label]
            counts[value] = counts.get(value, 0.0) + sample.value
    return counts
