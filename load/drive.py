"""The load generator's one driver: one request measured as a client sees it (status, TTFT,
inter-token gaps, end to end, what Sluice's response headers say: which backend, the route,
the prompt token count, the preprocessing and queue durations of `server-timing`, a refusal's
Retry-After; and the prompt tokens the backend's cache served, where its `usage` says), and the
loads made of them: open loop (requests at planned times) and closed loop (clients that each
send when their last answer came), all on load/client.py. Errors are sorted by kind, so a
report can tell a refused request from a reset connection from a stream that broke half-way.

Open loop: every send time is planned in advance and every request is its own task, so a
slow server never delays the next send (no coordinated omission); past `max_inflight`
requests an arrival is recorded as `client_overflow` instead of queued. Closed loop: each
client takes the next request from one shared source until it runs dry or time is up; a
client whose request failed to connect or was reset waits 10 ms before its next (a refused
connection does not spin). Both return every request's `Record` and the wall time; with a
`label`, a progress line (done, errors, rate, p50/p99 of the last 500) on a terminal.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import trio

from load import arrivals
from load.client import (
    ERRORS,
    NO_TIMEOUT,
    ONE_TOKEN_REQUEST,
    ConnectFailed,
    Connection,
    Pool,
    Prepared,
)
from load.stats import percentile
from load.workloads import Request

# Error kinds besides "http_<status>".
CONNECT, TIMEOUT, RESET, STREAM_BROKEN, NO_DONE = (
    "connect",
    "timeout",
    "reset",
    "stream_broken",
    "no_done",
)
COMPLETION_TOKENS = b'"completion_tokens"'
CACHED_TOKENS = b'"cached_tokens"'
USAGE = b'"usage"'
NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')  # a usage chunk's: not a token
COUNT = re.compile(rb"\s*:\s*(\d+)")
CLIENT_OVERFLOW = "client_overflow"
BACK_OFF_S = 0.01
Item = Request | Prepared
Plan = Iterable[tuple[float, Item]]  # (seconds from the start, what to send), in time order


@dataclass(slots=True)
class Record:
    """One request's outcome; times in seconds, `start` relative to the run's start."""

    tag: str
    start: float
    ok: bool = False
    status: int = 0
    error: str | None = None
    e2e: float | None = None
    ttft: float | None = None
    itl: float | None = None  # mean gap between output chunks after the first
    tpot: float | None = None  # (e2e - ttft) / (output tokens - 1)
    output_tokens: int = 0
    backend: str | None = None
    route: str | None = None
    prompt_tokens: str | None = None
    server_timing: str | None = None  # the header as sent; `timing` parses it
    retry_after: str | None = None  # a refusal's Retry-After header
    # The backend's `usage.prompt_tokens_details.cached_tokens` (a stream's only if it asked
    # for `stream_options.include_usage`); None when the answer did not say.
    cached_tokens: int | None = None
    # Every gap between a stream's output chunks (asked for with `keep_gaps`: a tail of
    # inter-token latency is a tail of gaps, which the mean `itl` hides); not in `as_dict`.
    gaps: list[float] | None = None

    @property
    def timing(self) -> dict[str, float]:
        return parse_server_timing(self.server_timing) if self.server_timing else {}

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["timing"] = self.timing
        del out["server_timing"], out["gaps"]
        return out


def parse_server_timing(value: str) -> dict[str, float]:
    """`template;dur=0.1, tokenize;dur=2.5` -> {"template": 0.0001, "tokenize": 0.0025} (s)."""
    timing: dict[str, float] = {}
    for part in value.split(","):
        name, _, params = part.strip().partition(";")
        for param in params.split(";"):
            key, _, number = param.strip().partition("=")
            if key == "dur" and name:
                with contextlib.suppress(ValueError):
                    timing[name] = float(number) / 1000
    return timing


async def _consume_stream(
    record: Record, connection: Connection, sent: float, keep_gaps: bool
) -> None:
    """Server-sent events to `[DONE]`: the time of each `data:` event, an error event."""
    times: list[float] = []
    pending = b""
    while (chunk := await connection.read_chunk()) is not None:
        now = time.perf_counter()
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                while await connection.read_chunk() is not None:  # the body's end
                    pass
                if times:
                    record.ttft = times[0] - sent
                    if len(times) > 1:
                        record.itl = (times[-1] - times[0]) / (len(times) - 1)
                    if keep_gaps:
                        record.gaps = [b - a for a, b in itertools.pairwise(times)]
                record.output_tokens = len(times)
                return
            if data.startswith(b'{"error"'):
                record.error = STREAM_BROKEN
                return
            if USAGE in data:
                record.cached_tokens = count_of(data, CACHED_TOKENS)
                if NO_CHOICES.search(data):
                    continue
            times.append(now)
    record.error = NO_DONE


def completion_tokens(body: bytes) -> int:
    """`usage.completion_tokens` of a JSON answer, found without parsing the whole answer."""
    return count_of(body, COMPLETION_TOKENS) or 0


def count_of(body: bytes, field: bytes) -> int | None:
    """The number after the first `field` (a quoted JSON key) in `body`; None if absent."""
    at = body.find(field)
    found = COUNT.match(body, at + len(field)) if at >= 0 else None
    return int(found.group(1)) if found else None


async def send(
    pool: Pool, item: Request | Prepared, start: float, keep_gaps: bool = False
) -> Record:
    """Send one request through `pool` and measure it; `start` is the run's zero on
    `time.perf_counter()`; `keep_gaps`: a stream's every inter-token gap kept. Without a pool
    timeout there is no cancel scope per request: the CPU benchmarks' clients stay lean."""
    prepared = item if type(item) is Prepared else pool.prepare(item)  # type: ignore[arg-type]
    sent = time.perf_counter()
    record = Record(prepared.tag, sent - start)
    try:
        with trio.fail_after(pool.timeout) if pool.timeout else NO_TIMEOUT:
            connection = await pool.start(prepared.data)
            try:
                headers = connection.headers
                record.status = status = connection.status
                record.backend = headers.get("x-sluice-backend")
                record.route = headers.get("x-sluice-route")
                record.prompt_tokens = headers.get("x-sluice-prompt-tokens")
                record.server_timing = headers.get("server-timing")
                if status != 200:
                    record.retry_after = headers.get("retry-after")
                    await connection.read_body()
                    record.error = f"http_{status}"
                elif prepared.streaming:
                    await _consume_stream(record, connection, sent, keep_gaps)
                else:
                    body = await connection.read_body()
                    record.output_tokens = completion_tokens(body)
                    record.cached_tokens = count_of(body, CACHED_TOKENS)
            finally:
                if not pool.keep(connection):
                    await connection.close()
    except ConnectFailed:
        record.error = CONNECT
    except trio.TooSlowError:
        record.error = TIMEOUT
    except ERRORS:
        record.error = RESET
    record.e2e = e2e = time.perf_counter() - sent
    if record.error is None:
        record.ok = True
        if record.ttft is None:
            record.ttft = e2e
        if record.output_tokens > 1:
            record.tpot = (e2e - record.ttft) / (record.output_tokens - 1)
    return record


def progress(text: str) -> None:
    """The one-line live view on a terminal, rewritten in place; nothing in a log."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{text}")
        sys.stderr.flush()


class Ticker:
    """Rewrites the progress line from `text()` every second while `run` runs."""

    def __init__(self, text: Callable[[], str]) -> None:
        self.text = text

    async def run(self) -> None:
        while sys.stderr.isatty():
            await trio.sleep(1.0)
            progress(self.text())


@dataclass
class Run:
    records: list[Record]
    seconds: float

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.records)

    @property
    def errors(self) -> int:
        return len(self.records) - self.ok

    def latencies(self) -> list[float]:
        """End-to-end seconds of the requests that succeeded."""
        return [r.e2e for r in self.records if r.ok and r.e2e is not None]


def progress_line(label: str, records: list[Record], start: float) -> Callable[[], str]:
    def text() -> str:
        done = len(records)
        errors = sum(1 for r in records if not r.ok)
        recent = [r.e2e for r in records[-500:] if r.ok and r.e2e is not None]
        elapsed = max(time.perf_counter() - start, 1e-9)
        return (
            f"{label}: {done} done, {errors} errors, {done / elapsed:.1f} req/s, "
            f"p50 {percentile(recent, 50) * 1e3:.0f} ms, p99 {percentile(recent, 99) * 1e3:.0f} ms"
        )

    return text


def poisson(item: Item, rate: float, seconds: float, seed: int) -> list[tuple[float, Item]]:
    """`item` at Poisson arrivals: the overhead scenario's open loop."""
    return [(at, item) for at in arrivals.schedule("poisson", rate, seconds, seed)]


def one_token(pool: Pool) -> Iterator[Prepared]:
    """The overhead scenario's one-token chat, built once, forever: a closed loop's source."""
    return itertools.repeat(pool.prepare(ONE_TOKEN_REQUEST))


async def open_loop(
    pool: Pool,
    plan: Plan,
    *,
    max_inflight: int | None = None,
    on_record: Callable[[Record], None] | None = None,
    label: str | None = None,
    start: float | None = None,
    keep_gaps: bool = False,
) -> Run:
    """Each item of `plan` at its time, each its own task; returns once every answer is in.
    A list is sorted by time first (stable: items of one instant keep their order). Records'
    `start` counts from `start` (a `time.perf_counter()`; default: now); `keep_gaps`: each
    stream's inter-token gaps kept (`Record.gaps`)."""
    if isinstance(plan, Sequence):
        plan = sorted(plan, key=lambda entry: entry[0])
    records: list[Record] = []
    inflight = 0
    began = time.perf_counter()
    start = began if start is None else start

    async def one(item: Item) -> None:
        nonlocal inflight
        inflight += 1
        try:
            record = await send(pool, item, start, keep_gaps)
        finally:
            inflight -= 1
        records.append(record)
        if on_record is not None:
            on_record(record)

    line = progress_line(label or "", records, start)
    async with trio.open_nursery() as nursery:
        if label:
            nursery.start_soon(Ticker(line).run)
        async with trio.open_nursery() as senders:
            t0 = trio.current_time()
            for at, item in plan:
                await trio.sleep_until(t0 + at)
                if max_inflight is not None and inflight >= max_inflight:
                    late = Record(item.tag, time.perf_counter() - start, error=CLIENT_OVERFLOW)
                    records.append(late)
                    continue
                senders.start_soon(one, item)
        nursery.cancel_scope.cancel()
    if label:
        progress(line() + "\n")
    return Run(records, time.perf_counter() - began)


async def closed_loop(
    pool: Pool,
    clients: int,
    source: Iterable[Item],
    *,
    seconds: float = math.inf,
    on_record: Callable[[Record], None] | None = None,
    label: str | None = None,
) -> Run:
    """`clients` clients, each sending the next item of `source` when its last answer came,
    until `seconds` have passed or `source` runs dry."""
    records: list[Record] = []
    items = iter(source)
    start = time.perf_counter()
    deadline = trio.current_time() + seconds

    async def client() -> None:
        while trio.current_time() < deadline:
            item = next(items, None)
            if item is None:
                return
            record = await send(pool, item, start)
            records.append(record)
            if on_record is not None:
                on_record(record)
            if record.error in (CONNECT, RESET, TIMEOUT):
                await trio.sleep(BACK_OFF_S)

    line = progress_line(f"{label} x{clients}", records, start)
    async with trio.open_nursery() as nursery:
        if label:
            nursery.start_soon(Ticker(line).run)
        async with trio.open_nursery() as workers:
            for _ in range(clients):
                workers.start_soon(client)
        nursery.cancel_scope.cancel()
    if label:
        progress(line() + "\n")
    return Run(records, time.perf_counter() - start)


async def send_plan(
    url: str, plan: Sequence[tuple[float, Request]], stream: bool = False, give_up_s: float = 300.0
) -> list[Record]:
    """`open_loop` on a pool of its own: each request of `plan` at its time (seconds from
    now), streamed if `stream`; every answer's record."""
    async with Pool(url, timeout=give_up_s) as pool:
        prepared = [(at, pool.prepare(request, stream)) for at, request in plan]
        return (await open_loop(pool, prepared)).records
