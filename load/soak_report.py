"""The soak's report: which failures are not Sluice's, what one minute counted, its line,
and the verdict at the end."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from load.drive import Record

EXPECTED_WHEN_DOWN = {"http_502", "http_503", "http_504", "stream_broken", "no_done"}
# Through Envoy a stream whose backend dies is reset (Envoy's way of saying it), where
# Sluice's proxy ends it with an error event (stream_broken).
EXPECTED_WHEN_DOWN_THROUGH_ENVOY = {*EXPECTED_WHEN_DOWN, "reset"}
Windows = list[list[float]]  # [start, end] times, s from the soak's start


def excuse(
    record: Record, down: Windows, shedding: Windows, when_down: set[str] = EXPECTED_WHEN_DOWN
) -> str | None:
    """Why a failed request is not lost to Sluice (a refusal that says when to come back, a
    backend that was down, a connection burst over --max-connections), or None: it was."""
    kind = record.error or "unknown"
    end = record.start + (record.e2e or 0.0)
    told_when = record.retry_after is not None
    if kind == "http_429" and told_when:
        return "429_retry_after"
    if kind in when_down and within(down, record.start, end):
        return f"backend_down:{kind}"
    if kind == "http_503" and told_when and within(shedding, record.start, end):
        return "shed_503"
    return None


def within(windows: Windows, start: float, end: float) -> bool:
    return any(start <= w[1] and end >= w[0] for w in windows)


@dataclass
class Minute:
    requests: int = 0
    ok: int = 0
    expected: Counter[str] = field(default_factory=Counter)
    sluice: Counter[str] = field(default_factory=Counter)
    # Each API key's outcomes: 200, 429 (with Retry-After), expected (other), lost.
    keys: dict[str, Counter[str]] = field(default_factory=dict)
    health_worst_s: float = 0.0
    health_worst_at: float = 0.0
    health_failures: int = 0
    stalls: dict[str, float] = field(default_factory=dict)
    rss_bytes: int = 0
    pid: int = 0  # the proxy process the RSS was read from (a crash starts a new one)
    cache_bytes: float | None = None  # L0 + L1, from /metrics: what of the RSS is caches


OUTCOMES = ("200", "429", "expected", "lost")


def kinds(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"


def by_key(keys: dict[str, Counter[str]]) -> str:
    """`heavy 120/30/0/0, light ...`: each key's outcomes in OUTCOMES' order."""
    return ", ".join(
        f"{key} {'/'.join(str(tally[o]) for o in OUTCOMES)}" for key, tally in sorted(keys.items())
    )


def print_minute(number: int, m: Minute) -> None:
    stalls = ", ".join(f"{k} {v:g}" for k, v in sorted(m.stalls.items())) or "none"
    caches = "" if m.cache_bytes is None else f" (caches {m.cache_bytes / 2**20:.1f} MiB)"
    print(
        f"min {number:2}: {m.requests} requests, {m.ok} ok | expected: {kinds(m.expected)} | "
        f"SLUICE'S FAULT: {kinds(m.sluice)} | {'/'.join(OUTCOMES)}: {by_key(m.keys)} | "
        f"/health worst {m.health_worst_s * 1e3:.1f} ms "
        f"at t={m.health_worst_at:.0f}s"
        f"{f' ({m.health_failures} failed)' if m.health_failures else ''} | stalls: {stalls} | "
        f"RSS {m.rss_bytes / 2**20:.1f} MiB{caches}",
        flush=True,
    )


def verdict(minutes: list[Minute], crashes: list[str], lost_examples: dict[str, str]) -> bool:
    lost = sum(sum(m.sluice.values()) for m in minutes)
    requests = sum(m.requests for m in minutes)
    # RSS growth of one process: up to the last minute before a crash replaced it.
    same = [m for m in minutes if m.pid == minutes[0].pid] if minutes else []
    first = same[0].rss_bytes if same else 0
    last = same[-1].rss_bytes if same else 0
    growth = (last / first - 1) * 100 if first else float("nan")
    # The tokenizer caches fill for minutes and are bounded by flags: what is judged is the
    # RSS besides them, where a leak would show (the whole RSS when their size is unknown).
    counted = (
        same[0].cache_bytes is not None and same[-1].cache_bytes is not None if same else False
    )
    rest = [m.rss_bytes - (m.cache_bytes or 0.0) for m in (same[0], same[-1])] if counted else []
    judged = (rest[1] / rest[0] - 1) * 100 if counted and rest[0] else growth
    worst = max((m.health_worst_s for m in minutes), default=0.0)
    passed = not crashes and lost == 0 and judged <= 10.0
    print(f"\nverdict after {len(minutes)} min, {requests} requests:")
    print(f"  crashes: {len(crashes)} (target 0) {crashes or ''}")
    print(f"  requests lost to Sluice itself: {lost} (target 0)")
    for example in lost_examples.values():
        print(f"    first: {example}")
    keys: dict[str, Counter[str]] = {}
    for m in minutes:
        for key, tally in m.keys.items():
            keys.setdefault(key, Counter()).update(tally)
    print(f"  by API key, {' / '.join(OUTCOMES)} (429s carry Retry-After): {by_key(keys)}")
    print(
        f"  proxy RSS: {first / 2**20:.1f} MiB after minute 1 -> {last / 2**20:.1f} MiB after "
        f"minute {len(same)} ({growth:+.1f}%)"
        + ("" if len(same) == len(minutes) else "; later minutes ran in a restarted proxy")
    )
    print(f"  worst /health: {worst * 1e3:.1f} ms (target of issue 7's benchmarks: <= 10 ms)")
    if counted:
        grown = ((same[-1].cache_bytes or 0.0) - (same[0].cache_bytes or 0.0)) / 2**20
        print(
            f"  of which the tokenizer caches (bounded by --l0-max-entries and --l1-max-memory): "
            f"{grown:+.1f} MiB; the RSS besides them: {rest[0] / 2**20:.1f} -> "
            f"{rest[1] / 2**20:.1f} MiB ({judged:+.1f}%, target <= +10%)"
        )
    else:
        print(f"  RSS growth judged whole: {growth:+.1f}% (target <= +10%)")
    print(f"  {'PASS' if passed else 'FAIL'}")
    return passed
