"""Recording each proxied request for the dashboard, from the proxy, in three calls:

    send = trace = metrics.traffic.trace(send, timing, kind)  # where a request starts
    trace.prepared(prepared)                                  # once it is tokenized
    trace.finish()                                            # where it ends

The trace *is* the ASGI `send` the rest of the request uses: it sees the response head (the
status, and the `x-sluice-backend`, `x-sluice-route` and `x-request-id` headers the proxy
sets on every proxied answer), the first body byte (time to first token; for an answer that
is not streamed, the whole answer) and the last one. So every answer is recorded, error
answers sent before any backend was chosen included, without the proxy passing anything
else along. `finish()` is for the request whose client left before the last byte: it is
recorded then, with 499. Recording costs a few microseconds a request, no I/O and no lock:
everything runs on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol

from app.observe.backend_stats import BackendStats
from app.observe.request_log import CLIENT_GONE_STATUS, RequestLog, RequestRecord, clip

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


class TimingLike(Protocol):
    """The proxy's per-request timing: when it started (perf_counter) and its phases (s)."""

    started: float
    template: float
    tokenize: float
    route: float


class PreparedLike(Protocol):
    """The preprocessed request: its fields but the prompt, and how it was tokenized."""

    @property
    def fields(self) -> Mapping[str, Any]: ...

    @property
    def token_ids(self) -> Any: ...

    @property
    def tokenize_path(self) -> str: ...


class TrafficRecorder:
    """The request log and per-backend stats that the proxy's traces feed."""

    def __init__(self, log_capacity: int = 200) -> None:
        self.log = RequestLog(log_capacity)
        self.backends = BackendStats()

    def trace(self, send: Send, timing: TimingLike, kind: str) -> RequestTrace:
        return RequestTrace(self, send, timing, kind)

    def add(self, record: RequestRecord, now: float) -> None:
        self.log.add(record)
        backend = record["backend"]
        if backend is not None:
            route = record["route"]
            reason = route.partition(":")[2] if route else None
            ttft = record["ttft_ms"]
            self.backends.record(backend, now, None if ttft is None else ttft / 1000, reason)

    def snapshot(self) -> dict[str, Any]:
        log = self.log
        return {
            "total": log.total,
            "by_class": dict(log.by_class),
            "capacity": log.capacity,
            "recent": log.recent(),
        }


class RequestTrace:
    __slots__ = (
        "_backend",
        "_complete",
        "_done",
        "_first_byte",
        "_kind",
        "_model",
        "_prompt_tokens",
        "_recorder",
        "_request_id",
        "_route",
        "_send",
        "_status",
        "_stream",
        "_timing",
        "_tokenize_path",
    )

    def __init__(self, recorder: TrafficRecorder, send: Send, timing: TimingLike, kind: str):
        self._recorder = recorder
        self._send = send
        self._timing = timing
        self._kind = kind
        self._model: str | None = None
        self._stream: bool | None = None  # unknown until the body was read
        self._prompt_tokens: int | None = None
        self._tokenize_path: str | None = None
        self._status: int | None = None
        self._backend: str | None = None
        self._route: str | None = None
        self._request_id: str | None = None
        self._first_byte: float | None = None
        self._complete = False  # the last body byte was handed to the server
        self._done = False

    def prepared(self, prepared: PreparedLike) -> None:
        """What the request asked for and how its prompt was tokenized (never the prompt)."""
        fields = prepared.fields
        self._model = clip(fields.get("model"))
        self._stream = fields.get("stream") is True
        ids = prepared.token_ids
        self._prompt_tokens = None if ids is None else len(ids)
        self._tokenize_path = prepared.tokenize_path

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._response_started(message)
        elif kind == "http.response.body":
            if self._first_byte is None and message.get("body"):
                self._first_byte = time.perf_counter()
            if not message.get("more_body", False):
                # Recorded as the last byte is handed over, not after: the server then
                # tells the proxy the exchange is over, which cancels the rest of this call.
                self._complete = True
                self.finish()
        await self._send(message)

    def _response_started(self, message: Message) -> None:
        self._status = int(message["status"])
        for name, value in message.get("headers", ()):
            if name == b"x-sluice-backend":
                self._backend = value.decode("latin-1")
            elif name == b"x-sluice-route":
                self._route = value.decode("latin-1")
            elif name == b"x-request-id":
                self._request_id = clip(value.decode("latin-1"))

    def finish(self) -> None:
        """Record the request once (later calls do nothing). Without a last body byte sent,
        the client left first: 499, or the status it had started to receive."""
        if self._done:
            return
        self._done = True
        now = time.perf_counter()
        timing = self._timing
        duration = now - timing.started
        first = self._first_byte
        recorder = self._recorder
        record: RequestRecord = {
            "seq": recorder.log.next_seq(),
            "time": round(time.time() - duration, 3),
            "id": self._request_id,
            "kind": self._kind,
            "model": self._model,
            "stream": self._stream,
            "backend": self._backend,
            "route": self._route,
            "prompt_tokens": self._prompt_tokens,
            "tokenize_path": self._tokenize_path,
            # Microseconds are enough, and the log is most of a snapshot's bytes.
            "template_ms": round(timing.template * 1000, 3),
            "tokenize_ms": round(timing.tokenize * 1000, 3),
            "route_ms": round(timing.route * 1000, 3),
            "status": CLIENT_GONE_STATUS if self._status is None else self._status,
            "ttft_ms": None if first is None else round((first - timing.started) * 1000, 3),
            "duration_ms": round(duration * 1000, 3),
            "client_gone": not self._complete,
        }
        recorder.add(record, now)
