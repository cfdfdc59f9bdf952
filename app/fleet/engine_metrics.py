"""What an inference engine says about its own load, read off its Prometheus text. Pure.

Four engines, recognised by the names in the exposition itself:

    engine    running                       waiting                     KV use
    vllm      vllm:num_requests_running     vllm:num_requests_waiting   vllm:kv_cache_usage_perc
    sglang    sglang:num_running_reqs       sglang:num_queue_reqs       sglang:token_usage
    llamacpp  llamacpp:requests_processing  llamacpp:requests_deferred  ...:kv_cache_usage_ratio
    tgi       tgi_batch_current_size        tgi_queue_size              (none)

vLLM before 0.9 named its KV use `vllm:gpu_cache_usage_perc`; llama.cpp builds since
ggml-org/llama.cpp#13660 report none, and TGI never did: KV use is then unknown (None).
The prefix-cache hit rate is vLLM's `prefix_cache_hits_total / prefix_cache_queries_total`
over the interval between two readings, or the engine's own gauge: SGLang's
`sglang:cache_hit_rate`, vLLM V0's `vllm:gpu_prefix_cache_hit_rate`.

Several samples of one name are several engines behind one server (vLLM's `engine` label for
data-parallel ranks, SGLang's `dp_rank`): counts add up, ratios average. Samples that differ
only in a replica label (SGLang's `tp_rank`, `pp_rank` when every scheduler reports) repeat
one scheduler's numbers and count once.

The text is searched for the few names wanted instead of parsed whole: vLLM's exposition is
~100 KB of histograms, and this runs on the proxy's event loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, TypedDict

EngineName = Literal["vllm", "sglang", "llamacpp", "tgi"]


@dataclass(frozen=True)
class _Signals:
    """One engine's metric names: for each figure, the names to try in order."""

    name: EngineName
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    hit_rate: tuple[str, ...] = ()
    prefix_queries: tuple[str, ...] = ()
    prefix_hits: tuple[str, ...] = ()
    # A restart shows as a counter that went back, or a new start time.
    prompt_tokens: tuple[str, ...] = ()
    started_at: tuple[str, ...] = ()
    # Histograms' sums and counts: a request's time in the queue, and between two tokens
    # (a step): together, whether it waited steps for room (room.py).
    queue_time: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    token_gap: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    replica_labels: frozenset[str] = frozenset()


ENGINES: tuple[_Signals, ...] = (
    _Signals(
        "vllm",
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        hit_rate=("vllm:gpu_prefix_cache_hit_rate",),
        prefix_queries=("vllm:prefix_cache_queries_total",),
        prefix_hits=("vllm:prefix_cache_hits_total",),
        prompt_tokens=("vllm:prompt_tokens_total",),
        # The counters' creation time is the engine's (one per data-parallel rank); the
        # process's start time is the API server's, which outlives an engine restart.
        started_at=(
            "vllm:prompt_tokens_created",
            "vllm:prefix_cache_queries_created",
            "process_start_time_seconds",
        ),
        queue_time=(
            ("vllm:request_queue_time_seconds_sum",),
            ("vllm:request_queue_time_seconds_count",),
        ),
        token_gap=(
            ("vllm:inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum"),
            (
                "vllm:inter_token_latency_seconds_count",
                "vllm:time_per_output_token_seconds_count",
            ),
        ),
    ),
    _Signals(
        "sglang",
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        hit_rate=("sglang:cache_hit_rate",),
        prompt_tokens=("sglang:prompt_tokens_total",),
        replica_labels=frozenset({"tp_rank", "pp_rank", "moe_ep_rank"}),
    ),
    _Signals(
        "llamacpp",
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        prompt_tokens=("llamacpp:prompt_tokens_total",),
    ),
    _Signals(
        "tgi",
        running=("tgi_batch_current_size",),
        waiting=("tgi_queue_size",),
        queue_time=(("tgi_request_queue_duration_sum",), ("tgi_request_queue_duration_count",)),
        token_gap=(
            ("tgi_request_mean_time_per_token_duration_sum",),
            ("tgi_request_mean_time_per_token_duration_count",),
        ),
    ),
)

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Sample:
    labels: Labels
    value: float


@dataclass(frozen=True)
class EngineReading:
    """One scrape's figures; the prefix counters need a second reading to become a rate."""

    engine: EngineName
    running: int | None
    waiting: int | None
    kv_cache_usage: float | None
    reported_hit_rate: float | None
    prefix_queries: float | None
    prefix_hits: float | None
    prompt_tokens: float | None = None
    started_at: float | None = None
    queue_time: tuple[float, float] | None = None  # (sum, count)
    token_gap: tuple[float, float] | None = None  # (sum, count)


@dataclass(frozen=True)
class EngineLoad:
    """What a backend's engine last said about itself, as the router and dashboard use it."""

    name: EngineName
    running: int | None
    waiting: int | None
    kv_cache_usage: float | None
    prefix_cache_hit_rate: float | None
    restarted: bool = False  # since the reading before: a counter went back, or a new start
    # Over the interval since the reading before, where the engine says: the mean time the
    # requests that finished had waited in its queue, and the mean gap between two tokens.
    queue_wait_s: float | None = None
    step_s: float | None = None


class EngineBlock(TypedDict):
    """A backend's `engine` block in the dashboard's snapshot: its `EngineLoad`."""

    name: EngineName
    running: int | None
    waiting: int | None
    kv_cache_usage: float | None
    prefix_cache_hit_rate: float | None
    restarted: bool
    queue_wait_s: float | None
    step_s: float | None


def engine_block(load: EngineLoad | None) -> EngineBlock | None:
    if load is None:
        return None
    return {
        "name": load.name,
        "running": load.running,
        "waiting": load.waiting,
        "kv_cache_usage": load.kv_cache_usage,
        "prefix_cache_hit_rate": load.prefix_cache_hit_rate,
        "restarted": load.restarted,
        "queue_wait_s": load.queue_wait_s,
        "step_s": load.step_s,
    }


def samples(text: str, name: str) -> Iterator[Sample]:
    """Every sample of exactly `name` in a Prometheus text exposition (comments skipped)."""
    start = 0
    while (found := text.find(name, start)) >= 0:
        start = found + len(name)
        at_line_start = found == 0 or text[found - 1] == "\n"
        if not at_line_start or text[start : start + 1] not in ("{", " ", "\t"):
            continue  # inside a comment or a value, or a longer name that starts with this one
        line_end = text.find("\n", start)
        parsed = _parse_rest(text[start : line_end if line_end >= 0 else len(text)])
        if parsed is not None:
            yield Sample(*parsed)


def _parse_rest(rest: str) -> tuple[Labels, float] | None:
    """`{labels} value [timestamp]` after a metric name, or None when malformed."""
    labels: list[tuple[str, str]] = []
    if rest.startswith("{"):
        i = 1
        while True:
            while rest[i : i + 1] in (" ", ","):
                i += 1
            if rest[i : i + 1] == "}":
                i += 1
                break
            equals = rest.find("=", i)
            if equals < 0 or rest[equals + 1 : equals + 2] != '"':
                return None
            key, value, i = rest[i:equals].strip(), [], equals + 2
            while i < len(rest) and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < len(rest):
                    i += 1
                    value.append({"n": "\n"}.get(rest[i], rest[i]))
                else:
                    value.append(rest[i])
                i += 1
            if i >= len(rest):
                return None  # unterminated label value
            labels.append((key, "".join(value)))
            i += 1
        rest = rest[i:]
    fields = rest.split()
    if not fields:
        return None
    try:
        number = float(fields[0])
    except ValueError:
        return None
    return (tuple(labels), number) if math.isfinite(number) else None


def _combined(
    found: Iterable[Sample], replica_labels: frozenset[str], *, average: bool
) -> float | None:
    """One figure for a whole server: replicas count once, engines add up (or average)."""
    by_engine: dict[Labels, float] = {}
    for sample in found:
        key = tuple(sorted(pair for pair in sample.labels if pair[0] not in replica_labels))
        by_engine[key] = max(sample.value, by_engine.get(key, sample.value))
    if not by_engine:
        return None
    total = sum(by_engine.values())
    return total / len(by_engine) if average else total


def _first(text: str, names: tuple[str, ...], signals: _Signals, *, average: bool) -> float | None:
    for name in names:
        value = _combined(samples(text, name), signals.replica_labels, average=average)
        if value is not None:
            return value
    return None


def read_engine(text: str) -> EngineReading | None:
    """The first engine whose running or waiting count the exposition has; None for none."""
    for signals in ENGINES:
        running = _first(text, signals.running, signals, average=False)
        waiting = _first(text, signals.waiting, signals, average=False)
        if running is None and waiting is None:
            continue
        return EngineReading(
            engine=signals.name,
            running=None if running is None else round(running),
            waiting=None if waiting is None else round(waiting),
            kv_cache_usage=_first(text, signals.kv_usage, signals, average=True),
            reported_hit_rate=_first(text, signals.hit_rate, signals, average=True),
            prefix_queries=_first(text, signals.prefix_queries, signals, average=False),
            prefix_hits=_first(text, signals.prefix_hits, signals, average=False),
            prompt_tokens=_first(text, signals.prompt_tokens, signals, average=False),
            started_at=_first(text, signals.started_at, signals, average=True),
            queue_time=_sum_count(text, signals.queue_time, signals),
            token_gap=_sum_count(text, signals.token_gap, signals),
        )
    return None


def _sum_count(
    text: str, names: tuple[tuple[str, ...], tuple[str, ...]], signals: _Signals
) -> tuple[float, float] | None:
    total = _first(text, names[0], signals, average=False)
    count = _first(text, names[1], signals, average=False)
    return None if total is None or count is None else (total, count)


def _interval_mean(
    now: tuple[float, float] | None, before: tuple[float, float] | None
) -> float | None:
    """A histogram's mean over the interval between two readings (None: nothing observed)."""
    if now is None or before is None:
        return None
    total, count = now[0] - before[0], now[1] - before[1]
    return total / count if count > 0 and total >= 0 else None


def next_load(
    reading: EngineReading, earlier: EngineReading | None, shown: EngineLoad | None
) -> EngineLoad:
    """The load to show after `reading`, given the reading before it and what it showed.

    vLLM's rate covers the prompts looked up between the two readings. With none looked up,
    the rate shown stands (an idle engine's cache did not change); after a counter went
    backwards (the engine restarted) or on the first reading, it is unknown until the next.
    A restart is told by a counter that went back or a start time that changed.
    """
    restarted = earlier is not None and _restarted(earlier, reading)
    before = earlier or reading
    rate = reading.reported_hit_rate
    if reading.prefix_queries is not None and reading.prefix_hits is not None:
        rate = None
        if (
            earlier is not None
            and earlier.prefix_queries is not None
            and earlier.prefix_hits is not None
        ):
            queried = reading.prefix_queries - earlier.prefix_queries
            hit = reading.prefix_hits - earlier.prefix_hits
            if queried > 0 and 0 <= hit <= queried:
                rate = hit / queried
            elif queried == 0 and hit == 0 and shown is not None:
                rate = shown.prefix_cache_hit_rate
    return EngineLoad(
        name=reading.engine,
        running=reading.running,
        waiting=reading.waiting,
        kv_cache_usage=reading.kv_cache_usage,
        prefix_cache_hit_rate=rate,
        restarted=restarted,
        queue_wait_s=None if restarted else _interval_mean(reading.queue_time, before.queue_time),
        step_s=None if restarted else _interval_mean(reading.token_gap, before.token_gap),
    )


def _restarted(earlier: EngineReading, reading: EngineReading) -> bool:
    before, now = earlier.started_at, reading.started_at
    if before is not None and now is not None and now != before:
        return True
    for before, now in (
        (earlier.prompt_tokens, reading.prompt_tokens),
        (earlier.prefix_queries, reading.prefix_queries),
    ):
        if before is not None and now is not None and now < before:
            return True
    return False
