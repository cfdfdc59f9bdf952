"""Answering one completion request: whole, or streamed as server-sent events.

The generation runs under a cancel scope that a watcher task cancels when the client
disconnects, so an abandoned request frees its batch slot and KV blocks immediately
instead of decoding to the end for nobody.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from app.asgi import Receive, Send, send_json
from app.sim.engine import SimEngine
from app.sim.openai_format import GenerationRequest, ResponseShapes

# A dropped stream still delivers a couple of tokens first, like a server dying mid-answer.
TOKENS_BEFORE_DROP = 2

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


@asynccontextmanager
async def cancelled_on_disconnect(receive: Receive) -> AsyncIterator[trio.CancelScope]:
    """Run the body until it finishes or the client goes; the scope may be cancelled too."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
        yield nursery.cancel_scope
        nursery.cancel_scope.cancel()


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def answer_whole(
    request: GenerationRequest,
    shapes: ResponseShapes,
    engine: SimEngine,
    pieces: Iterator[str],
    receive: Receive,
    send: Send,
) -> None:
    text: list[str] = []

    async def collect(_index: int) -> None:
        text.append(next(pieces))

    async with cancelled_on_disconnect(receive):
        cached = await engine.generate(request.prompt_tokens, request.output_tokens, collect)
        body = shapes.response(
            "".join(text),
            request.finish_reason,
            len(request.prompt_tokens),
            len(text),
            cached,
        )
        await send_json(send, 200, body)


async def answer_stream(
    request: GenerationRequest,
    shapes: ResponseShapes,
    engine: SimEngine,
    pieces: Iterator[str],
    drop_mid_stream: bool,
    receive: Receive,
    send: Send,
) -> None:
    """One chunk per token as it is produced, an optional usage chunk, then `[DONE]`.

    A dropped stream returns without the final empty body message: under ASGI that makes
    the server close the connection with the response unfinished, as a crashed backend would.
    """
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    last = request.output_tokens - 1
    drop_at = min(TOKENS_BEFORE_DROP, last) if drop_mid_stream else None

    async with cancelled_on_disconnect(receive) as scope:

        async def emit(index: int) -> None:
            if index == drop_at:
                scope.cancel()
                # Deliver the cancellation here, so nothing more is sent.
                await trio.lowlevel.checkpoint()
            if index == 0 and request.kind == "chat":
                await _send_event(send, shapes.role_chunk())
            finish_reason = request.finish_reason if index == last else None
            await _send_event(send, shapes.token_chunk(next(pieces), finish_reason))

        cached = await engine.generate(request.prompt_tokens, request.output_tokens, emit)
        if request.include_usage:
            usage = shapes.usage_chunk(len(request.prompt_tokens), request.output_tokens, cached)
            await _send_event(send, usage)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _send_event(send: Send, payload: dict[str, Any]) -> None:
    data = json.dumps(payload, separators=(",", ":")).encode()
    await send(
        {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}
    )
