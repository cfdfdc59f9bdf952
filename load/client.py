"""One request, measured as a client sees it: status, TTFT, inter-token gaps, end to end,
and what Sluice's response headers say (which backend, the preprocessing durations of
`server-timing`, the prompt token count).

Errors are sorted by kind, so a report can tell a refused request from a reset connection
from a stream that broke half-way.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import trio

from load.workloads import Request

# Error kinds besides "http_<status>".
CONNECT, TIMEOUT, RESET, STREAM_BROKEN, NO_DONE = (
    "connect",
    "timeout",
    "reset",
    "stream_broken",
    "no_done",
)


@dataclass
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
    timing: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def _read_headers(record: Record, response: httpx.Response) -> None:
    record.status = response.status_code
    record.backend = response.headers.get("x-sluice-backend")
    record.route = response.headers.get("x-sluice-route")
    record.prompt_tokens = response.headers.get("x-sluice-prompt-tokens")
    timing = response.headers.get("server-timing")
    if timing:
        record.timing = parse_server_timing(timing)


async def _consume_stream(record: Record, response: httpx.Response, sent: float) -> None:
    chunks: list[float] = []
    done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        if '"error"' in data and data.startswith('{"error"'):
            record.error = STREAM_BROKEN
            return
        chunks.append(time.perf_counter())
    if not done:
        record.error = NO_DONE
        return
    if chunks:
        record.ttft = chunks[0] - sent
        if len(chunks) > 1:
            record.itl = (chunks[-1] - chunks[0]) / (len(chunks) - 1)
    record.output_tokens = len(chunks)


def _count_output(record: Record, payload: bytes) -> None:
    try:
        usage = json.loads(payload).get("usage") or {}
        record.output_tokens = int(usage.get("completion_tokens", 0))
    except (ValueError, AttributeError, TypeError):
        record.output_tokens = 0


async def send(
    client: httpx.AsyncClient, base_url: str, request: Request, stream: bool, start: float
) -> Record:
    """Send `request` to `base_url`; `start` is the run's zero on `time.perf_counter()`."""
    sent = time.perf_counter()
    record = Record(tag=request.tag, start=sent - start)
    body = dict(request.body)
    if stream:
        body["stream"] = True
    try:
        async with client.stream("POST", base_url + request.path, json=body) as response:
            _read_headers(record, response)
            if response.status_code != 200:
                await response.aread()
                record.error = f"http_{response.status_code}"
            elif stream:
                await _consume_stream(record, response, sent)
            else:
                _count_output(record, await response.aread())
    except httpx.ConnectError:
        record.error = CONNECT
    except httpx.TimeoutException:
        record.error = TIMEOUT
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        record.error = RESET
    record.e2e = time.perf_counter() - sent
    record.ok = record.error is None
    if record.ok:
        if record.ttft is None:
            record.ttft = record.e2e
        if record.output_tokens > 1:
            record.tpot = (record.e2e - record.ttft) / (record.output_tokens - 1)
    return record


def new_client(connections: int, timeout: float = 300.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


async def send_plan(
    url: str, plan: Sequence[tuple[float, Request]], stream: bool = False
) -> list[Record]:
    """Each request of `plan` at its time (seconds from now), each its own task, so a slow
    answer never delays the next send; returns once every answer is in."""
    records: list[Record] = []
    async with new_client(len(plan) or 1) as client:
        start = time.perf_counter()

        async def fire(request: Request) -> None:
            records.append(await send(client, url, request, stream, start))

        async with trio.open_nursery() as nursery:
            t0 = trio.current_time()
            for at, request in sorted(plan, key=lambda item: item[0]):
                await trio.sleep_until(t0 + at)
                nursery.start_soon(fire, request)
    return records
