"""Pure bookkeeping for event-loop stalls: no Trio, no clocks of its own, no I/O.

- `frames_of_task` keeps the frames of one task from the loop thread's stack and proves the
  stack was taken inside it; `stall_stage` names the stage of Sluice's own code it shows.
- `StallRing` keeps the last N distinct stalls, folding equal ones into a count.
- `BoundedLabels` caps Prometheus label cardinality for unbounded task names.
- `summarize_histogram` and `RecentMax` turn raw numbers into what a dashboard shows.

Times are passed in by the caller, so every piece is tested with an injected clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any, NamedTuple, NotRequired, TypedDict

from app.errors import require_at_least
from app.observe.stall_causes import BLOCKING, GIL_WAIT, PREEMPTED, UNKNOWN


class Frame(NamedTuple):
    file: str
    line: int | None
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{'?' if self.line is None else self.line} {self.func}"


def frames_of_task(frames: Sequence[Frame], root_file: str, root_func: str) -> list[Frame] | None:
    """The frames from the innermost out to the task's root coroutine, dropping the scheduler.

    None when the root coroutine is not on the stack: it was taken outside that task
    (an alarm that fired earlier, during another step), so it says nothing about this stall.
    """
    for index in range(len(frames) - 1, -1, -1):
        if frames[index].func == root_func and frames[index].file == root_file:
            return list(frames[: index + 1])
    return None


# `stall_stage` when a stall has neither a stack nor a phase, or a stack with no frame of ours.
NO_STACK = "(no stack)"
OUTSIDE_APP = "(outside app)"


def stall_stage(frames: Sequence[Frame] | None, phase: str | None, package_dir: str) -> str:
    """The stage a stall's time is charged to: the innermost frame of the package in
    `package_dir` (Sluice's `app/`) on its stack, as `app.routing.block_index:chain_hashes`;
    else the request phase the code declared; else why neither is known.

    The innermost frame of ours, not the innermost frame: a stall inside `json.loads` or a
    C call belongs to the stage that made the call, and a label per library frame would
    name the same stage many ways.
    """
    root = package_dir.rstrip("/")
    for frame in frames or ():
        if frame.file.startswith(root + "/"):
            relative = frame.file[len(root) + 1 :].removesuffix(".py").replace("/", ".")
            module = root.rsplit("/", 1)[-1] + "." + relative.removesuffix(".__init__")
            return f"{module}:{frame.func}"
    if phase:
        return phase
    return OUTSIDE_APP if frames else NO_STACK


class StallRecord(TypedDict):
    """A distinct stall, as the ring keeps it and the dashboard lists it (`loop.recent`)."""

    task: str | None
    phase: str | None
    stack: list[str]  # innermost frame first
    cause: str
    count: int
    first_time: float
    last_time: float
    last_duration_s: float
    max_duration_s: float
    # How the latest occurrence's time went, by cause (stall_causes.CauseSplit.to_json).
    last_split_s: dict[str, float] | None
    worker: NotRequired[int]  # a supervisor's merged view: the worker that saw it


class HistogramBucket(TypedDict):
    le: float | str  # the bucket's upper bound; "+Inf" for the last
    count: float  # observations in this bucket alone (not cumulative)


class HistogramSummary(TypedDict):
    """A histogram as the dashboard shows it (`summarize_histogram`)."""

    buckets: list[HistogramBucket]
    count: float
    sum: float
    p50: float | None
    p99: float | None


class StallRing:
    """The last `capacity` distinct stalls; a repeat of a known one updates it in place.

    Two stalls are the same when task, phase, stack and cause are equal: a stack alone would
    merge every stall whose stack could not be captured, and the same step preempted once
    and blocking once are two different stories.
    """

    def __init__(self, capacity: int) -> None:
        require_at_least(1, capacity=capacity)
        self._capacity = capacity
        self._records: OrderedDict[tuple[Any, ...], StallRecord] = OrderedDict()

    def add(
        self,
        *,
        time: float,
        duration_s: float,
        task: str | None,
        phase: str | None,
        stack: Sequence[str],
        cause: str,
        split: dict[str, float] | None = None,
    ) -> StallRecord:
        key = (task, phase, tuple(stack), cause)
        record = self._records.get(key)
        if record is None:
            record = {
                "task": task,
                "phase": phase,
                "stack": list(stack),
                "cause": cause,
                "count": 0,
                "first_time": time,
                "last_time": time,
                "last_duration_s": duration_s,
                "max_duration_s": duration_s,
                "last_split_s": split,
            }
            self._records[key] = record
            if len(self._records) > self._capacity:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(key)
        record["count"] += 1
        record["last_time"] = time
        record["last_duration_s"] = duration_s
        record["max_duration_s"] = max(record["max_duration_s"], duration_s)
        record["last_split_s"] = split
        return record

    def recent(self) -> list[StallRecord]:
        """Newest first, each a copy: the ring updates its own records in place."""
        return [record.copy() for record in reversed(self._records.values())]

    def __len__(self) -> int:
        return len(self._records)


class BoundedLabels:
    """Passes the first `limit` distinct names through and folds later ones into `overflow`."""

    def __init__(self, limit: int, overflow: str = "other") -> None:
        self._limit = limit
        self._overflow = overflow
        self._seen: set[str] = set()

    def label(self, name: str) -> str:
        if name in self._seen:
            return name
        if len(self._seen) < self._limit:
            self._seen.add(name)
            return name
        return self._overflow


class RecentMax:
    """The largest value added during the last `window_s` (a monotonic queue: O(1) amortised)."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._candidates: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        candidates = self._candidates
        while candidates and candidates[-1][1] <= value:
            candidates.pop()
        candidates.append((now, value))
        self._expire(now)

    def value(self, now: float) -> float:
        self._expire(now)
        return self._candidates[0][1] if self._candidates else 0.0

    def _expire(self, now: float) -> None:
        while self._candidates and now - self._candidates[0][0] > self._window_s:
            self._candidates.popleft()


def estimate_quantile(
    q: float, bounds: Sequence[float], cumulative: Sequence[float]
) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket holding the rank.

    `cumulative` has one count per bound plus the +Inf bucket last. A rank that falls in
    +Inf reports the highest finite bound. None for an empty histogram.
    """
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    below = 0.0
    for index, upper in enumerate(bounds):
        if cumulative[index] >= rank:
            lower = bounds[index - 1] if index else 0.0
            in_bucket = cumulative[index] - below
            return lower + (upper - lower) * (rank - below) / in_bucket if in_bucket else upper
        below = cumulative[index]
    return bounds[-1]


def summarize_histogram(
    bounds: Sequence[float], cumulative: Sequence[float], total_sum: float
) -> HistogramSummary:
    """Per-bucket (not cumulative) counts, count, sum, p50 and p99, ready for JSON."""
    if len(cumulative) != len(bounds) + 1:
        raise ValueError("cumulative needs one count per bound plus +Inf")
    edges: list[float | str] = [*bounds, "+Inf"]
    previous = 0.0
    buckets: list[HistogramBucket] = []
    for edge, running in zip(edges, cumulative, strict=True):
        buckets.append({"le": edge, "count": running - previous})
        previous = running
    return {
        "buckets": buckets,
        "count": cumulative[-1],
        "sum": total_sum,
        "p50": estimate_quantile(0.5, bounds, cumulative),
        "p99": estimate_quantile(0.99, bounds, cumulative),
    }


def format_stall_report(record: StallRecord, duration_s: float, suppressed: int) -> str:
    """The log line: duration, cause, task, phase, how the time went, then the stack.

    Only a `blocking` stall is said to be "in" its task; the GIL or the OS stalled the loop
    "during" a task that is not at fault.
    """
    split = record["last_split_s"]
    if record["cause"] == GIL_WAIT and split is not None:
        cause = f" (gil-wait: another thread held the GIL for {split[GIL_WAIT] * 1e3:.1f} ms)"
    elif record["cause"] == PREEMPTED and split is not None:
        cause = (
            f" (preempted: the OS ran other work for {split[PREEMPTED] * 1e3:.1f} ms;"
            " not the task's doing)"
        )
    else:
        cause = f" ({record['cause']})"
    where = "in" if record["cause"] in (BLOCKING, UNKNOWN) else "during"
    task = f"task {record['task']!r}" if record["task"] is not None else "an unknown task"
    phase = f" in phase {record['phase']}" if record["phase"] else ""
    shares = (
        "; " + ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in split.items())
        if split is not None
        else ""
    )
    seen = f" (seen {record['count']} times)" if record["count"] > 1 else ""
    dropped = f"; {suppressed} reports suppressed before this one" if suppressed else ""
    stack = (
        "\n  ".join(["stack, innermost first:", *record["stack"]])
        if record["stack"]
        else "stack not captured"
    )
    return (
        f"event loop stalled {duration_s * 1e3:.1f} ms{cause} {where} {task}{phase}{shares}"
        f"{seen}{dropped}\n  {stack}"
    )
