"""Answering one completion request: whole, or streamed as server-sent events.

A client that disconnects cancels its request (the server does it, app/http/connection.py), so an
abandoned request frees its batch slot and KV blocks at once instead of decoding to the end
for nobody.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from app.http.exchange import Exchange
from app.sim.engine import SimEngine
from app.sim.openai_format import GenerationRequest, ResponseShapes

# A dropped stream still delivers a couple of tokens first, like a server dying mid-answer.
TOKENS_BEFORE_DROP = 2

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _Dropped(Exception):
    """The stream stops here, unfinished (the close-mid-stream fault)."""


async def answer_whole(
    request: GenerationRequest,
    shapes: ResponseShapes,
    engine: SimEngine,
    pieces: Iterator[str],
    exchange: Exchange,
) -> None:
    text: list[str] = []

    async def collect(_index: int) -> None:
        text.append(next(pieces))

    cached = await engine.generate(request.prompt_tokens, request.output_tokens, collect)
    body = shapes.response(
        "".join(text),
        request.finish_reason,
        len(request.prompt_tokens),
        len(text),
        cached,
    )
    await exchange.respond_json(200, body)


async def answer_stream(
    request: GenerationRequest,
    shapes: ResponseShapes,
    engine: SimEngine,
    pieces: Iterator[str],
    drop_mid_stream: bool,
    exchange: Exchange,
) -> None:
    """One chunk per token as it is produced, an optional usage chunk, then `[DONE]`.

    A dropped stream returns without ending the body: the server then closes the connection
    with the answer unfinished, as a crashed backend would.
    """
    await exchange.start(200, _SSE_HEADERS, complete=False)
    last = request.output_tokens - 1
    drop_at = min(TOKENS_BEFORE_DROP, last) if drop_mid_stream else None

    async def emit(index: int) -> None:
        if index == drop_at:
            raise _Dropped
        if index == 0 and request.kind == "chat":
            await exchange.write(_event(shapes.role_chunk()))
        finish_reason = request.finish_reason if index == last else None
        await exchange.write(_event(shapes.token_chunk(next(pieces), finish_reason)))

    try:
        cached = await engine.generate(request.prompt_tokens, request.output_tokens, emit)
    except _Dropped:
        return
    done = b"data: [DONE]\n\n"
    if request.include_usage:
        usage = shapes.usage_chunk(len(request.prompt_tokens), request.output_tokens, cached)
        done = _event(usage) + done
    await exchange.end(done)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
