"""A backend's answer as the client's `Reply`, relayed as it arrives: the per-token hot path.

`reply_from` turns the backend's response head (and what came with it) into a `Reply` whose
`Passage` is the body's source: the exchange sends the head and first bytes, then hands the
rest to the relay hub (app/http/relay_hub.py), one task for every stream, and parks until it
has ended. The hub calls `Passage.take` once per read of the backend (decode the framing,
convert for `--forward tokens`, keep the tail) and writes what one read brought in one frame
and one write: whatever arrived between two reads goes out together, so a busy proxy
coalesces tokens and an idle one adds no delay. A backend silent for `idle` seconds ends the
stream (the hub's sweep); a client slow to take the answer is back-pressure, not a silent
backend.
Nothing else runs per token: usage, `cached_tokens` and the finish reason are read from the
tail once the answer has ended (routing/usage.py), the request's trace reads the exchange's
first-byte time once, and there is no per-chunk metric.

On a failure mid-answer an event stream the engine had finished (its API's end marker is in
the tail: endpoints.py) ends cleanly, counted as untidy; one cut before its end gets its API's
error event and a clean end; any other body ends without its end, so the server drops the
connection rather than let a truncated JSON document look complete. A `Converter` may rewrite
what passes (a stored response's id, the chat shape for `--forward tokens`). `chat_reply_from`
is for `--forward tokens` chat requests: the backend answered a completion, the client gets a
chat completion (chat_conversion.py). The passage keeps what the request's bookkeeping reads
once the answer has ended: its tail (usage), and whether it broke.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from app.errors import UpstreamError, UpstreamFault
from app.http.client import UpstreamResponse
from app.http.fields import Headers
from app.http.relay_hub import RelayHub
from app.http.reply import Reply, error_reply, whole
from app.preprocess.endpoints import CHAT, Endpoint
from app.proxy.chat_conversion import ChatStreamConverter, completion_to_chat
from app.proxy.headers import downstream_headers, is_event_stream
from app.routing.usage import TAIL_BYTES

log = logging.getLogger("sluice.forward")


class Converter(Protocol):
    """Rewrites an answer's body as it passes, read by read."""

    def feed(self, data: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class Passage:
    """An answer's body on its way (the reply's `BodySource`): each read decoded (and
    converted), its tail kept, how it ended noted."""

    __slots__ = (
        "_converter",
        "_endpoint",
        "_response",
        "_started",
        "broken_by",
        "hub",
        "idle",
        "stream",
        "tail",
        "untidy",
    )

    def __init__(
        self,
        response: UpstreamResponse,
        converter: Converter | None,
        endpoint: Endpoint,
        hub: RelayHub,
        idle: float,
        started: Callable[[], None],
    ) -> None:
        self._response = response
        self._converter = converter
        self._endpoint = endpoint
        self._started = started
        self.stream = response.stream
        self.hub = hub
        self.idle = idle
        self.tail = b""  # the answer's last TAIL_BYTES, where its usage is
        self.broken_by: UpstreamError | None = None  # None while the answer goes well
        self.untidy = False  # cut after its engine had finished it: ended cleanly all the same

    def take(self, raw: bytes) -> bytes:
        """The content of one read of the backend's socket."""
        return self._keep(self._response.decode(raw))

    def take_arrived(self) -> bytes:
        """The content that came with the response's head."""
        return self._keep(self._response.take_arrived())

    def _keep(self, data: bytes) -> bytes:
        if self._converter is not None:
            data = self._converter.feed(data)
        if data:
            self.tail = (self.tail + data)[-TAIL_BYTES:]
        return data

    def complete(self) -> bool:
        return self._response.complete

    def last(self, data: bytes) -> bytes:
        """The body's last content (converted already), and what the converter still held."""
        if self._converter is None:
            return data
        held = self._converter.finish()
        if held:
            self.tail = (self.tail + held)[-TAIL_BYTES:]
        return data + held

    def started(self) -> None:
        self._started()

    def broken(self, failure: UpstreamError) -> bytes | None:
        rest = self.last(b"")
        if not is_event_stream(self._response):
            log.warning("backend broke off its answer: %s", failure)
            self.broken_by = failure
            return None
        if self._endpoint.finished_in(self.tail):
            log.info("stream cut after its end (%s): ended cleanly", failure)
            self.untidy = True
            return rest
        log.warning("stream broke: %s", failure)
        self.broken_by = failure
        return rest + self._endpoint.broken(f"The backend stream broke: {failure.detail}")

    async def release(self) -> None:
        await self._response.release()


async def reply_from(
    response: UpstreamResponse,
    extra_headers: Headers,
    idle: float,
    hub: RelayHub,
    converter: Converter | None = None,
    endpoint: Endpoint = CHAT,
    *,
    started: Callable[[], None] = lambda: None,
) -> tuple[Reply, Passage]:
    """The client's reply to `response` (through `converter` if given), and its passage;
    `started()` when its body's first bytes go out (the engine runs the request).
    `UpstreamError` if the body is broken before anything was sent."""
    headers = downstream_headers(response, extra_headers)
    if converter is not None:  # it changes the body's length: chunked, unless all is here
        headers = [(name, value) for name, value in headers if name != b"content-length"]
    passage = Passage(response, converter, endpoint, hub, idle, started)
    first = passage.take_arrived()
    if not response.complete:
        return Reply(response.status_code, headers, first, passage), passage
    await response.release()
    body = passage.last(first)
    if converter is not None:
        headers.append((b"content-length", b"%d" % len(body)))
    return Reply(response.status_code, headers, body), passage


async def chat_reply_from(
    response: UpstreamResponse,
    extra_headers: Headers,
    idle: float,
    hub: RelayHub,
    *,
    started: Callable[[], None] = lambda: None,
) -> tuple[Reply, Passage]:
    """A backend's completion as a chat completion; errors (4xx/5xx) pass unchanged.

    A whole answer is read before anything is sent (it is small, and its length changes), so
    a failure while reading it raises `UpstreamError`: the client has nothing yet and the
    request can still be retried elsewhere.
    """
    if response.status_code != 200:
        return await reply_from(response, extra_headers, idle, hub, started=started)
    if is_event_stream(response):
        converter = ChatStreamConverter()
        return await reply_from(response, extra_headers, idle, hub, converter, started=started)
    body = await response.read_rest(idle)
    passage = Passage(response, None, CHAT, hub, idle, started)
    await response.release()
    try:
        converted = completion_to_chat(body)
    except ValueError as exc:
        detail = f"the backend's completion cannot be returned as a chat completion: {exc}"
        passage.broken_by = failure = UpstreamError(UpstreamFault.UNUSABLE, detail)
        return error_reply(failure, extra_headers), passage
    headers = [
        (k, v) for k, v in downstream_headers(response, extra_headers) if k != b"content-length"
    ]
    passage.tail = converted[-TAIL_BYTES:]
    return whole(200, headers, converted), passage
