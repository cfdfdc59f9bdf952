"""Answering one generation request: whole, or streamed as server-sent events.

A client that disconnects cancels its request (the server does it, app/http/connection.py), so an
abandoned request frees its batch slot and KV blocks at once instead of decoding to the end
for nobody. `collect` and `stream_sse` serve every generating endpoint (OpenAI's chat and
completions here, the Responses API, Anthropic's Messages, transcriptions); each brings its
own bytes for the head, each token and the tail of a stream. A `Leg` (kv_transfer.py) says how
the engine runs the request in a disaggregated fleet: decode only, or one token whose KV is
kept for a decode engine.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from app.errors import WireError
from app.http.exchange import Exchange
from app.sim.engine import SimEngine
from app.sim.kv_transfer import Leg
from app.sim.openai_format import GenerationRequest, ResponseShapes

# A dropped stream still delivers a couple of tokens first, like a server dying mid-answer.
TOKENS_BEFORE_DROP = 2

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _Dropped(WireError):
    """The stream stops here, unfinished (the close-mid-stream fault)."""


async def collect(
    engine: SimEngine,
    prompt: Sequence[int],
    output_tokens: int,
    pieces: Iterator[str],
    leg: Leg | None = None,
) -> tuple[str, int]:
    """The whole generated text and how many prompt tokens the prefix cache served."""
    text: list[str] = []

    async def gather(_index: int) -> None:
        text.append(next(pieces))

    cached = await generate(engine, prompt, output_tokens, gather, leg)
    return "".join(text), cached


async def generate(
    engine: SimEngine,
    prompt: Sequence[int],
    output_tokens: int,
    emit: Callable[[int], Awaitable[None]],
    leg: Leg | None,
) -> int:
    """`engine.generate` as the request's leg says."""
    if leg is None:
        return await engine.generate(prompt, output_tokens, emit)
    return await engine.generate(
        prompt, output_tokens, emit, prefilled=leg.prefilled, keep=leg.keep
    )


async def stream_sse(
    exchange: Exchange,
    engine: SimEngine,
    prompt: Sequence[int],
    output_tokens: int,
    drop_mid_stream: bool,
    *,
    head: bytes,
    token: Callable[[int], bytes],
    tail: Callable[[int], bytes],
    leg: Leg | None = None,
) -> None:
    """`head` at once, `token(i)` as output token i is produced, then `tail(cached_tokens)`.

    A dropped stream returns without ending the body: the server then closes the connection
    with the answer unfinished, as a crashed backend would.
    """
    await exchange.start(200, SSE_HEADERS, head, complete=False)
    drop_at = min(TOKENS_BEFORE_DROP, output_tokens - 1) if drop_mid_stream else None

    async def emit(index: int) -> None:
        if index == drop_at:
            raise _Dropped
        await exchange.write(token(index))

    try:
        cached = await generate(engine, prompt, output_tokens, emit, leg)
    except _Dropped:
        return
    await exchange.end(tail(cached))


def sse_data(payload: dict[str, Any]) -> bytes:
    """One `data:` event, as OpenAI's chat and completions streams carry them."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    """One named event (`event:` then `data:`), as the Responses and Messages APIs stream."""
    return f"event: {name}\n".encode() + sse_data(payload)


async def answer_whole(
    request: GenerationRequest,
    shapes: ResponseShapes,
    engine: SimEngine,
    pieces: Iterator[str],
    exchange: Exchange,
    leg: Leg | None = None,
) -> None:
    prompt, output_tokens = request.prompt_tokens, request.output_tokens
    text, cached = await collect(engine, prompt, output_tokens, pieces, leg)
    body = shapes.response(text, request.finish_reason, len(prompt), output_tokens, cached)
    if leg is not None:
        body |= leg.answer_fields
    await exchange.respond_json(200, body)


async def answer_stream(
    request: GenerationRequest,
    shapes: ResponseShapes,
    engine: SimEngine,
    pieces: Iterator[str],
    drop_mid_stream: bool,
    exchange: Exchange,
    leg: Leg | None = None,
) -> None:
    """One chunk per token as it is produced, an optional usage chunk, then `[DONE]`."""
    last = request.output_tokens - 1

    def token(index: int) -> bytes:
        finish_reason = request.finish_reason if index == last else None
        chunk = sse_data(shapes.token_chunk(next(pieces), finish_reason))
        if index == 0 and request.kind == "chat":
            return sse_data(shapes.role_chunk()) + chunk
        return chunk

    def tail(cached: int) -> bytes:
        done = b"data: [DONE]\n\n"
        if not request.include_usage:
            return done
        prompt = len(request.prompt_tokens)
        return sse_data(shapes.usage_chunk(prompt, request.output_tokens, cached)) + done

    await stream_sse(
        exchange,
        engine,
        request.prompt_tokens,
        request.output_tokens,
        drop_mid_stream,
        head=b"",
        token=token,
        tail=tail,
        leg=leg,
    )
