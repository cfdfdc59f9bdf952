"""Recording each proxied request for the dashboard, from the proxy, in a few calls:

    trace = metrics.traffic.trace(timing, kind)      # where a request starts
    trace.prepared(prepared)                         # once it is tokenized
    trace.routed(backend, route, request_id)         # as a backend's answer starts to flow
    trace.finish(answer)                             # where it ends, however it ends

`finish` reads what the answer became from the exchange with the client once: its status,
when its first body byte went out (time to first token; for an answer that is not
streamed, the whole answer) and whether its last byte did. A request whose client left
first is recorded with 499. Nothing is done per chunk of a streamed answer. Recording costs
a few microseconds a request, no I/O and no lock: everything runs on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NotRequired, Protocol, TypedDict

from app.observe.backend_stats import BackendStats
from app.observe.request_log import (
    CLIENT_GONE_STATUS,
    LegsRecord,
    RequestLog,
    RequestRecord,
    clip,
)


class RequestRates(TypedDict):
    """Added by the dashboard's feed, over its last ticks."""

    per_s: NotRequired[float | None]
    errors_per_s: NotRequired[float | None]


class RequestsSnapshot(RequestRates):
    """The `requests` block of the dashboard's snapshot: the request log and its counts."""

    total: int
    by_class: dict[str, int]  # 2xx, 4xx, 5xx, client_gone
    capacity: int
    oldest_seq: int  # the log's oldest record (total + 1: none)
    recent: list[RequestRecord]  # newest first


class TimingLike(Protocol):
    """The proxy's per-request timing: when it started (perf_counter) and its phases (s)."""

    started: float
    template: float
    tokenize: float
    route: float
    queue: float  # held at the gate, every engine of its pool saturated


class PreparedLike(Protocol):
    """The preprocessed request: its fields but the prompt, and how it was tokenized."""

    @property
    def fields(self) -> Mapping[str, Any]: ...

    @property
    def model(self) -> str | None: ...  # the served model, once resolved

    @property
    def token_ids(self) -> Any: ...

    @property
    def tokenize_path(self) -> str: ...


class AnswerLike(Protocol):
    """The answer as the client got it: app/http/exchange.py's Exchange."""

    @property
    def status(self) -> int | None: ...

    @property
    def first_byte_at(self) -> float | None: ...  # perf_counter

    @property
    def complete(self) -> bool: ...


class TrafficRecorder:
    """The request log and per-backend stats that the proxy's traces feed."""

    def __init__(self, log_capacity: int = 200) -> None:
        self.log = RequestLog(log_capacity)
        self.backends = BackendStats()

    def trace(self, timing: TimingLike, kind: str) -> RequestTrace:
        return RequestTrace(self, timing, kind)

    def add(self, trace: RequestTrace, now: float) -> None:
        self.log.add(trace)
        if trace.backend is not None:
            self.backends.record(trace.backend, now, trace.ttft_s, trace.route_reason)

    def snapshot(self) -> RequestsSnapshot:
        log = self.log
        return {
            "total": log.total,
            "by_class": dict(log.by_class),
            "capacity": log.capacity,
            "oldest_seq": log.total - len(log) + 1,
            "recent": log.recent(),
        }


class RequestTrace:
    __slots__ = (
        "_complete",
        "_ended",
        "_first_byte_at",
        "_kind",
        "_legs",
        "_model",
        "_prompt_tokens",
        "_recorder",
        "_request_id",
        "_route",
        "_stream",
        "_timing",
        "_tokenize_path",
        "_wall_ended",
        "backend",
        "route_reason",
        "status",
        "trace_id",
    )

    def __init__(self, recorder: TrafficRecorder, timing: TimingLike, kind: str):
        self._recorder = recorder
        self._timing = timing
        self._kind = kind
        self._model: str | None = None
        self._stream: bool | None = None  # unknown until the body was read
        self._prompt_tokens: int | None = None
        self._tokenize_path: str | None = None
        self.backend: str | None = None
        self._route: str | None = None
        self.route_reason: str | None = None
        self._request_id: str | None = None
        self.status = CLIENT_GONE_STATUS
        self.trace_id: str | None = None  # its W3C trace, continued or started
        self._first_byte_at: float | None = None
        self._complete = False
        self._ended = self._wall_ended = 0.0
        self._legs: LegsRecord | None = None

    @property
    def model(self) -> str | None:
        """The served model, once the request's was resolved (a bounded set of names)."""
        return self._model

    @property
    def ended(self) -> float:
        """perf_counter when it finished (0.0 before)."""
        return self._ended

    @property
    def ttft_s(self) -> float | None:
        first = self._first_byte_at
        return None if first is None else first - self._timing.started

    def prepared(self, prepared: PreparedLike) -> None:
        """What the request asked for and how its prompt was tokenized (never the prompt)."""
        fields = prepared.fields
        self._model = prepared.model
        self._stream = fields.get("stream") is True
        ids = prepared.token_ids
        self._prompt_tokens = None if ids is None else len(ids)
        self._tokenize_path = prepared.tokenize_path

    def routed(self, backend: str, route: str, request_id: bytes) -> None:
        """The backend whose answer is being relayed (the last one tried), and why."""
        self.backend = backend
        self._route = route
        self.route_reason = route.partition(":")[2]
        self._request_id = clip(request_id.decode("latin-1"))

    def legs(self, mode: str, prefill: str | None, prefill_s: float | None) -> None:
        """A disaggregated model's request: served in two hops (`prefill` the engine that
        prefilled it, its leg's seconds), or in one (`mode` says why)."""
        self._legs = {
            "mode": mode,
            "prefill": prefill,
            "prefill_ms": None if prefill_s is None else round(prefill_s * 1000, 3),
            "transfer": prefill is not None,
        }

    def finish(self, answer: AnswerLike) -> None:
        """Record the request. Without its last byte sent, the client left first: 499, or
        the status it had started to receive."""
        self._ended = now = time.perf_counter()
        self._wall_ended = time.time()
        status = answer.status
        if status is not None:
            self.status = status
        self._first_byte_at = answer.first_byte_at
        self._complete = answer.complete
        self._recorder.add(self, now)

    def record(self, seq: int) -> RequestRecord:
        """What the dashboard lists: made when it asks, from what `finish` kept."""
        timing = self._timing
        duration = self._ended - timing.started
        ttft = self.ttft_s
        record: RequestRecord = {
            "seq": seq,
            "time": round(self._wall_ended - duration, 3),
            "id": self._request_id,
            "trace_id": self.trace_id,
            "kind": self._kind,
            "model": self._model,
            "stream": self._stream,
            "backend": self.backend,
            "route": self._route,
            "prompt_tokens": self._prompt_tokens,
            "tokenize_path": self._tokenize_path,
            # Microseconds are enough, and the log is most of a snapshot's bytes.
            "template_ms": round(timing.template * 1000, 3),
            "tokenize_ms": round(timing.tokenize * 1000, 3),
            "route_ms": round(timing.route * 1000, 3),
            "queue_ms": round(timing.queue * 1000, 3),
            "status": self.status,
            "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
            "duration_ms": round(duration * 1000, 3),
            "client_gone": not self._complete,
        }
        if self._legs is not None:
            record["legs"] = self._legs
        return record
