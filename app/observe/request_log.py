"""The live request log: the last N finished requests, what the dashboard lists. Pure.

A record says how a request went — when, which model, which backend and why, how many
prompt tokens and where they came from, how long each phase took, the status — and never
what it said: no prompt text, no message, no header but the request id, no API key. Text
that a client controls (model name, request id) is clipped, so a record's size is bounded
whatever the client sends.
"""

from __future__ import annotations

from collections import deque
from typing import NotRequired, Protocol, TypedDict

from app.errors import require_at_least

MAX_TEXT = 96  # characters kept of a client-chosen string (model, request id)
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": no response was finished


class LegsRecord(TypedDict):
    """How a request of a disaggregated model was served: two hops, or one and why."""

    mode: str  # disaggregated, or "aggregated (REASON)"
    prefill: str | None  # the prefill engine's URL (two hops)
    prefill_ms: float | None  # its leg, request to whole answer
    transfer: bool  # the prefill's answer named a KV transfer the decode leg carried


class RequestRecord(TypedDict):
    seq: int  # 1, 2, 3... in the order requests finished: lets a page render only new rows
    time: float  # Unix seconds when the request arrived
    id: str | None  # x-request-id (the client's, or the one Sluice made)
    trace_id: str | None  # the W3C trace it belongs to (the caller's, or one Sluice started)
    kind: str  # its endpoint: chat, completion, responses, messages, embeddings, ...
    model: str | None
    stream: bool | None
    backend: str | None  # the backend that answered; None when none did
    route: str | None  # policy:reason, as in x-sluice-route
    prompt_tokens: int | None  # None: not tokenized (bail-out, or refused before)
    tokenize_path: str | None  # l0 | l1 | thread | fallback | inline | bailed_out | given
    template_ms: float
    tokenize_ms: float
    route_ms: float
    queue_ms: float  # held at the proxy while every engine of its model was saturated
    status: int  # the status sent to the client, or 499 if it left before a response
    ttft_ms: float | None  # until the first body byte went to the client
    duration_ms: float
    client_gone: bool  # the client disconnected before the response was complete
    legs: NotRequired[LegsRecord]  # a disaggregated model's request: its prefill and decode
    worker: NotRequired[int]  # a supervisor's merged log: the worker that served it


def clip(text: object) -> str | None:
    """A client-chosen value as bounded text; None when absent or not a string."""
    if not isinstance(text, str):
        return None
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def status_class(status: int) -> str:
    """2xx, 4xx, 5xx... and `client_gone` for 499, which no server sent."""
    return "client_gone" if status == CLIENT_GONE_STATUS else f"{status // 100}xx"


class Finished(Protocol):
    """A finished request as the log keeps it: its record is made only when the dashboard
    asks, a few times a second, not for each of thousands of requests a second."""

    @property
    def status(self) -> int: ...

    def record(self, seq: int) -> RequestRecord: ...


class RequestLog:
    """The newest `capacity` finished requests, plus running totals by status class."""

    def __init__(self, capacity: int = 200) -> None:
        require_at_least(1, capacity=capacity)
        self.capacity = capacity
        self._finished: deque[tuple[int, Finished]] = deque(maxlen=capacity)
        self.total = 0
        self.by_class: dict[str, int] = {}
        self._classes: dict[int, str] = {}  # status -> its class, named once per status
        self._made: dict[int, RequestRecord] = {}  # seq -> its record, once asked for

    def add(self, finished: Finished) -> None:
        self.total += 1
        self._finished.append((self.total, finished))
        status = finished.status
        key = self._classes.get(status)
        if key is None:
            key = self._classes[status] = status_class(status)
        self.by_class[key] = self.by_class.get(key, 0) + 1

    @property
    def server_errors(self) -> int:
        return self.by_class.get("5xx", 0)

    def recent(self) -> list[RequestRecord]:
        """Newest first. A record is made once, the first time it is asked for (the page asks
        every second; a record never changes), and kept while its request is in the log."""
        made = self._made
        kept: dict[int, RequestRecord] = {}
        for seq, finished in reversed(self._finished):
            record = made.get(seq)
            kept[seq] = record if record is not None else finished.record(seq)
        self._made = kept
        return list(kept.values())

    def __len__(self) -> int:
        return len(self._finished)
