"""The stall detector's pure parts, without Trio or real time.

Covers (app/observe/stalls.py, and stack_capture.own_stack): the stack of a live frame,
innermost first, keeping only a task's frames, the ring's de-duplication (cause included) and
bound, the log rate limiter and the label budget with an injected clock, the recent-max
window, histogram quantiles, the report text, which names the cause and never blames a
task for a stall the GIL or the OS caused, and the stage a stall's time is charged to.
"""

from __future__ import annotations

import json
import sys

import pytest

from app.observe.rate_limit import RateLimiter
from app.observe.stack_capture import own_stack
from app.observe.stalls import (
    NO_STACK,
    OUTSIDE_APP,
    BoundedLabels,
    Frame,
    RecentMax,
    StallRing,
    estimate_quantile,
    format_stall_report,
    frames_of_task,
    stall_stage,
    summarize_histogram,
)


def _called_from_here() -> list[Frame]:
    return own_stack(sys._getframe())


def test_a_live_frames_stack_is_read_innermost_first() -> None:
    stack = _called_from_here()

    assert [frame.func for frame in stack[:2]] == [
        "_called_from_here",
        "test_a_live_frames_stack_is_read_innermost_first",
    ]
    assert (
        stack[0].file == __file__ and stack[0].line == _called_from_here.__code__.co_firstlineno + 1
    )
    assert str(stack[0]) == f"{__file__}:{stack[0].line} _called_from_here"
    assert own_stack(None) == []


def test_frames_of_task_cuts_at_the_root_coroutine_and_rejects_foreign_dumps() -> None:
    stack = [
        Frame("a.py", 3, "encode_prompt"),
        Frame("a.py", 9, "handle"),
        Frame("a.py", 9, "handle"),
        Frame("run.py", 1, "unrolled_run"),
    ]
    assert frames_of_task(stack, "a.py", "handle") == stack[:3]
    assert frames_of_task(stack, "b.py", "handle") is None


def test_a_stall_is_charged_to_the_innermost_frame_of_ours_else_to_its_phase() -> None:
    ours = "/src/app"
    stack = [
        Frame("/usr/lib/python3.11/json/decoder.py", 353, "raw_decode"),
        Frame("/src/app/routing/block_index.py", 50, "chain_hashes"),
        Frame("/src/app/proxy/app.py", 200, "_complete"),
    ]
    assert stall_stage(stack, "template", ours) == "app.routing.block_index:chain_hashes"
    package = [Frame("/src/app/observe/__init__.py", 1, "f")]
    assert stall_stage(package, None, ours) == "app.observe:f"
    # A sibling directory whose name starts like ours is not ours.
    foreign = [Frame("/src/application/x.py", 1, "f")]
    assert stall_stage(foreign, "template", ours) == "template"
    assert stall_stage(foreign, None, ours) == OUTSIDE_APP
    assert stall_stage(None, None, ours) == stall_stage([], None, ours) == NO_STACK


def _add(ring: StallRing, time: float, duration: float, stack: list[str], task: str = "t") -> None:
    ring.add(time=time, duration_s=duration, task=task, phase=None, stack=stack, cause="blocking")


def test_ring_folds_equal_stalls_into_one_record() -> None:
    ring = StallRing(capacity=4)
    _add(ring, 1.0, 0.030, ["a.py:1 f"])
    _add(ring, 2.0, 0.080, ["a.py:1 f"])
    _add(ring, 3.0, 0.020, ["a.py:1 f"])

    [record] = ring.recent()
    assert (record["count"], record["first_time"], record["last_time"]) == (3, 1.0, 3.0)
    assert (record["last_duration_s"], record["max_duration_s"]) == (0.020, 0.080)
    as_json = json.loads(json.dumps(record))
    assert (as_json["stack"], as_json["cause"]) == (["a.py:1 f"], "blocking")


def test_ring_keeps_stalls_apart_by_task_phase_stack_and_cause() -> None:
    ring = StallRing(capacity=8)
    ring.add(time=1, duration_s=0.1, task="a", phase=None, stack=[], cause="blocking")
    ring.add(time=2, duration_s=0.1, task="b", phase=None, stack=[], cause="blocking")
    ring.add(time=3, duration_s=0.1, task="a", phase="template", stack=[], cause="blocking")
    ring.add(time=4, duration_s=0.1, task="a", phase=None, stack=["x.py:1 f"], cause="blocking")
    ring.add(time=5, duration_s=0.1, task="a", phase=None, stack=[], cause="preempted")
    assert len(ring) == 5
    assert [record["cause"] for record in ring.recent()][:2] == ["preempted", "blocking"]


def test_ring_is_bounded_and_a_repeat_counts_as_recent() -> None:
    ring = StallRing(capacity=2)
    _add(ring, 1.0, 0.1, ["one"])
    _add(ring, 2.0, 0.1, ["two"])
    _add(ring, 3.0, 0.1, ["one"])
    _add(ring, 4.0, 0.1, ["three"])

    assert [record["stack"] for record in ring.recent()] == [["three"], ["one"]]


def test_ring_rejects_zero_capacity() -> None:
    with pytest.raises(ValueError):
        StallRing(capacity=0)


def test_rate_limiter_admits_five_a_minute_and_counts_the_rest() -> None:
    limiter = RateLimiter(limit=5, period_s=60.0)
    assert [limiter.admit(float(t)) for t in range(5)] == [0, 0, 0, 0, 0]
    assert limiter.admit(10.0) is None
    assert limiter.admit(59.9) is None
    # The window slides: the first admission (t=0) leaves it at t=60.
    assert limiter.admit(60.0) == 2
    assert limiter.admit(60.5) is None
    assert limiter.admit(61.0) == 1


def test_bounded_labels_fold_new_names_into_other_once_full() -> None:
    labels = BoundedLabels(limit=2)
    assert [labels.label(name) for name in ["a", "b", "c", "a", "d", "b"]] == [
        "a",
        "b",
        "other",
        "a",
        "other",
        "b",
    ]


def test_recent_max_forgets_values_older_than_the_window() -> None:
    recent = RecentMax(window_s=10.0)
    assert recent.value(0.0) == 0.0
    recent.add(0.0, 0.5)
    recent.add(1.0, 0.1)
    recent.add(2.0, 0.3)
    assert recent.value(5.0) == 0.5
    assert recent.value(10.5) == 0.3
    assert recent.value(12.5) == 0.0


BOUNDS = (0.001, 0.01, 0.1)


def test_quantiles_interpolate_inside_the_bucket() -> None:
    cumulative = (50.0, 90.0, 100.0, 100.0)
    assert estimate_quantile(0.5, BOUNDS, cumulative) == pytest.approx(0.001)
    assert estimate_quantile(0.7, BOUNDS, cumulative) == pytest.approx(0.0055)
    assert estimate_quantile(0.99, BOUNDS, cumulative) == pytest.approx(0.091)


def test_quantiles_of_empty_and_overflowing_histograms() -> None:
    assert estimate_quantile(0.5, BOUNDS, (0.0, 0.0, 0.0, 0.0)) is None
    assert estimate_quantile(0.99, BOUNDS, (0.0, 0.0, 1.0, 10.0)) == 0.1


def test_summary_gives_per_bucket_counts_as_json() -> None:
    summary = summarize_histogram(BOUNDS, (2.0, 3.0, 3.0, 4.0), 1.5)

    assert [bucket["count"] for bucket in summary["buckets"]] == [2.0, 1.0, 0.0, 1.0]
    assert summary["buckets"][-1]["le"] == "+Inf"
    assert (summary["count"], summary["sum"]) == (4.0, 1.5)
    assert json.loads(json.dumps(summary)) == summary
    with pytest.raises(ValueError):
        summarize_histogram(BOUNDS, (1.0,), 0.0)


SPLIT = {"blocking": 0.0021, "gil-wait": 0.0012, "preempted": 0.049}


def test_report_names_duration_cause_task_phase_stack_and_suppressed_reports() -> None:
    ring = StallRing(capacity=4)
    record = ring.add(
        time=1.0,
        duration_s=0.0523,
        task="handle",
        phase="tokenize-inline",
        stack=["a.py:3 f"],
        cause="blocking",
        split={"blocking": 0.0501, "gil-wait": 0.0, "preempted": 0.0022},
    )
    report = format_stall_report(record, 0.0523, suppressed=4)

    assert report.startswith(
        "event loop stalled 52.3 ms (blocking) in task 'handle' in phase tokenize-inline; "
        "blocking 50.1 ms, gil-wait 0.0 ms, preempted 2.2 ms"
    )
    assert "4 reports suppressed" in report
    assert report.endswith("a.py:3 f")
    unknown = ring.add(time=2.0, duration_s=0.02, task=None, phase=None, stack=[], cause="unknown")
    assert "(unknown) in an unknown task" in format_stall_report(unknown, 0.02, 0)
    assert "stack not captured" in format_stall_report(unknown, 0.02, 0)


def test_report_of_a_preempted_or_gil_stall_does_not_blame_the_task() -> None:
    ring = StallRing(capacity=4)
    preempted = ring.add(
        time=1.0, duration_s=0.052, task="HealthChecker.check", phase=None, stack=[],
        cause="preempted", split=SPLIT,
    )  # fmt: skip
    report = format_stall_report(preempted, 0.052, 0)
    assert report.startswith(
        "event loop stalled 52.0 ms (preempted: the OS ran other work for 49.0 ms; not the "
        "task's doing) during task 'HealthChecker.check'"
    )
    assert " in task" not in report
    gil = ring.add(
        time=1.0, duration_s=0.052, task="handle", phase=None, stack=[], cause="gil-wait",
        split={**SPLIT, "gil-wait": 0.045},
    )  # fmt: skip
    assert "(gil-wait: another thread held the GIL for 45.0 ms) during task 'handle'" in (
        format_stall_report(gil, 0.052, 0)
    )
