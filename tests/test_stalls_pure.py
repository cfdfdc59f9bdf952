"""The stall detector's pure parts, without Trio or real time (app/observe/stalls.py).

Covers: parsing faulthandler dumps (captured text and a live dump), keeping only a task's
frames, the ring's de-duplication and bound, the log rate limiter and the label budget with
an injected clock, the recent-max window, histogram quantiles and the report text.
"""

from __future__ import annotations

import faulthandler
import json
import tempfile
import threading

import pytest

from app.observe.stalls import (
    BoundedLabels,
    Frame,
    RateLimiter,
    RecentMax,
    StallRing,
    estimate_quantile,
    format_stall_report,
    frames_of_task,
    parse_thread_stack,
    summarize_histogram,
)

LOOP_THREAD = 0x7F364543FB80
WORKER_THREAD = 0x7F36448376C0

# Two dumps from faulthandler's SIGALRM handler (CPython 3.11) in one file: the first a
# stale one, the second taken by the loop thread ("Current thread") inside a C call.
CAPTURED_DUMPS = """\
Current thread 0x00007f364543fb80 (most recent call first):
  File "/srv/old.py", line 1 in stale

Thread 0x00007f36448376c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f364543fb80 (most recent call first):
  File "/srv/app/preprocess.py", line 88 in tokenize_inline
  File "/srv/app/proxy.py", line 41 in handle
  File "<frozen runpy>", line ??? in ???
  File "/srv/trio/_core/_run.py", line 2498 in unrolled_run
"""


def test_parser_takes_the_latest_section_of_the_loop_thread_innermost_first() -> None:
    stack = parse_thread_stack(CAPTURED_DUMPS, LOOP_THREAD)

    assert stack == [
        Frame("/srv/app/preprocess.py", 88, "tokenize_inline"),
        Frame("/srv/app/proxy.py", 41, "handle"),
        Frame("<frozen runpy>", None, "???"),
        Frame("/srv/trio/_core/_run.py", 2498, "unrolled_run"),
    ]
    assert str(stack[0]) == "/srv/app/preprocess.py:88 tokenize_inline"
    assert str(stack[2]) == "<frozen runpy>:? ???"


def test_parser_reads_other_threads_and_reports_missing_ones() -> None:
    worker = parse_thread_stack(CAPTURED_DUMPS, WORKER_THREAD)
    assert worker is not None
    assert [frame.func for frame in worker] == ["wait", "run"]
    assert parse_thread_stack(CAPTURED_DUMPS, 0x1234) is None
    assert parse_thread_stack("", LOOP_THREAD) is None


def _dump_this_thread() -> str:
    with tempfile.TemporaryFile() as file:
        faulthandler.dump_traceback(file, all_threads=True)
        file.seek(0)
        return file.read().decode()


def test_parser_reads_a_live_dump_of_the_current_thread() -> None:
    dump = _dump_this_thread()
    stack = parse_thread_stack(dump, threading.get_ident())

    assert stack is not None
    assert [frame.func for frame in stack[:2]] == [
        "_dump_this_thread",
        "test_parser_reads_a_live_dump_of_the_current_thread",
    ]
    assert stack[0].file == __file__


def test_frames_of_task_cuts_at_the_root_coroutine_and_rejects_foreign_dumps() -> None:
    stack = [
        Frame("a.py", 3, "encode_prompt"),
        Frame("a.py", 9, "handle"),
        Frame("a.py", 9, "handle"),
        Frame("run.py", 1, "unrolled_run"),
    ]
    assert frames_of_task(stack, "a.py", "handle") == stack[:3]
    assert frames_of_task(stack, "b.py", "handle") is None


def _add(ring: StallRing, time: float, duration: float, stack: list[str], task: str = "t") -> None:
    ring.add(time=time, duration_s=duration, task=task, phase=None, stack=stack)


def test_ring_folds_equal_stalls_into_one_record() -> None:
    ring = StallRing(capacity=4)
    _add(ring, 1.0, 0.030, ["a.py:1 f"])
    _add(ring, 2.0, 0.080, ["a.py:1 f"])
    _add(ring, 3.0, 0.020, ["a.py:1 f"])

    [record] = ring.recent()
    assert (record.count, record.first_time, record.last_time) == (3, 1.0, 3.0)
    assert (record.last_duration_s, record.max_duration_s) == (0.020, 0.080)
    assert json.loads(json.dumps(record.to_json()))["stack"] == ["a.py:1 f"]


def test_ring_keeps_stalls_apart_by_task_phase_and_stack() -> None:
    ring = StallRing(capacity=8)
    ring.add(time=1, duration_s=0.1, task="a", phase=None, stack=[])
    ring.add(time=2, duration_s=0.1, task="b", phase=None, stack=[])
    ring.add(time=3, duration_s=0.1, task="a", phase="template", stack=[])
    ring.add(time=4, duration_s=0.1, task="a", phase=None, stack=["x.py:1 f"])
    assert len(ring) == 4


def test_ring_is_bounded_and_a_repeat_counts_as_recent() -> None:
    ring = StallRing(capacity=2)
    _add(ring, 1.0, 0.1, ["one"])
    _add(ring, 2.0, 0.1, ["two"])
    _add(ring, 3.0, 0.1, ["one"])
    _add(ring, 4.0, 0.1, ["three"])

    assert [record.stack for record in ring.recent()] == [("three",), ("one",)]


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


def test_report_names_duration_task_phase_stack_and_suppressed_reports() -> None:
    ring = StallRing(capacity=2)
    record = ring.add(
        time=1.0, duration_s=0.0523, task="handle", phase="tokenize-inline", stack=["a.py:3 f"]
    )
    report = format_stall_report(record, 0.0523, suppressed=4)

    assert report.startswith("event loop stalled 52.3 ms in task 'handle' in phase tokenize-inline")
    assert "4 reports suppressed" in report
    assert report.endswith("a.py:3 f")
    unknown = ring.add(time=2.0, duration_s=0.02, task=None, phase=None, stack=[])
    assert "unknown task" in format_stall_report(unknown, 0.02, 0)
    assert "stack not captured" in format_stall_report(unknown, 0.02, 0)
