"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as vLLM serves it.

vLLM turns a Messages request into a chat completion (vllm/entrypoints/anthropic/serving.py):
the system prompt as a system message, each message's text blocks joined, tool results as
tool messages. The sim does the same and generates through the engine like any chat. The
answers are vLLM's: the whole message serialised without its null fields, its id the chat
completion's (`chatcmpl-...`); a stream of `event:` + `data:` pairs (message_start,
content_block_start, a content_block_delta per token, content_block_stop, message_delta,
message_stop) with no `ping`, which vLLM does not send.

Errors come in two shapes, as from vLLM: a body that fails validation (a missing
`max_tokens`, a message without a role) is its OpenAI-shaped 400, answered before the
endpoint runs; what the endpoint refuses (an unknown model, a prompt too long, the error
fault) is Anthropic's `{"type": "error", "error": {"type", "message"}}`.

`max_tokens` is a cap here, as Anthropic means it: the sim's answer is `default_max_tokens`
long (stop_reason `end_turn`) unless `max_tokens` is lower (`max_tokens`). Clients send
1024 or more by habit; generating all of it would make every request a long one.
`stop_sequences` are accepted and never met.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from app.errors import ClientError, Shape
from app.http.exchange import Exchange
from app.sim.generation import collect, sse_event
from app.sim.inference import Inference
from app.sim.openai_format import check_context_length, request_error
from app.sim.tokens import render_chat

_ROLES = frozenset({"user", "assistant", "system"})


@dataclass(frozen=True)
class MessagesRequest:
    messages: list[dict[str, Any]]  # as chat messages
    max_tokens: int | None
    stream: bool


def parse_messages_request(payload: dict[str, Any], *, counting: bool = False) -> MessagesRequest:
    """The validation vLLM's pydantic model does (OpenAI-shaped 400s)."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise request_error("Field required: `model` must be a non-empty string", param="model")
    max_tokens = payload.get("max_tokens")
    if not counting and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise request_error("`max_tokens` must be a positive integer", param="max_tokens")
    stream = payload.get("stream") or False
    if not isinstance(stream, bool):
        raise request_error("`stream` must be a boolean", param="stream")
    stops = payload.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(stop, str) for stop in stops)
    ):
        raise request_error("`stop_sequences` must be a list of strings", param="stop_sequences")
    raw = payload.get("messages")
    if not isinstance(raw, list):
        raise request_error("`messages` must be a list", param="messages")
    messages: list[dict[str, Any]] = []
    system = payload.get("system")
    if system:
        messages.append({"role": "system", "content": _blocks_text(system, "system")})
    for message in raw:
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise request_error("every message needs a role of user or assistant", param="messages")
        messages.extend(_chat_messages(message))
    return MessagesRequest(messages, max_tokens if not counting else None, stream)


def _chat_messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become tool messages."""
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": message["role"], "content": content}]
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise request_error("`content` must be a string or a list of blocks", param="messages")
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            text.append(f"{block.get('name', '')}({arguments})")
        elif kind == "tool_result":
            out.append({"role": "tool", "content": _blocks_text(block.get("content") or "", "")})
    if text or not out:
        out.append({"role": message["role"], "content": "".join(text)})
    return out


def _blocks_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(block, dict) for block in value):
        return "".join(str(b.get("text", "")) for b in value if b.get("type") == "text")
    raise request_error("expected a string or a list of text blocks", param=param or None)


@dataclass(frozen=True)
class MessagesEndpoints:
    inference: Inference

    async def count_tokens(self, exchange: Exchange) -> None:
        payload = await self.inference.read_json(exchange)
        request = parse_messages_request(payload, counting=True)
        with _anthropic_errors():
            self.inference.model(payload)
            prompt = self.inference.tokenizer.encode(render_chat(request.messages))
        await exchange.respond_json(200, {"input_tokens": len(prompt)})

    async def create(self, exchange: Exchange) -> None:
        inference = self.inference
        payload = await inference.read_json(exchange)
        request = parse_messages_request(payload)
        assert request.max_tokens is not None
        with _anthropic_errors():
            model = inference.model(payload)
            prompt = inference.tokenizer.encode(render_chat(request.messages))
            check_context_length(inference.settings, len(prompt), request.max_tokens, "messages")
            await inference.admit(len(prompt))
        output_tokens = min(request.max_tokens, inference.settings.default_max_tokens)
        stop_reason = "max_tokens" if output_tokens == request.max_tokens else "end_turn"
        message_id = f"chatcmpl-{uuid.uuid4().hex}"
        usage = {"input_tokens": len(prompt), "output_tokens": output_tokens}
        pieces = inference.pieces(prompt)
        if not request.stream:
            text, _cached = await collect(inference.engine, prompt, output_tokens, pieces)
            message = _message(message_id, model, [{"type": "text", "text": text}])
            await exchange.respond_json(200, message | {"stop_reason": stop_reason, "usage": usage})
            return

        def token(index: int) -> bytes:
            delta = sse_event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": next(pieces)},
                },
            )
            if index:
                return delta
            start = _message(message_id, model, [])
            start |= {
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": len(prompt), "output_tokens": 0},
            }
            block = {"type": "text", "text": ""}
            return (
                sse_event("message_start", {"type": "message_start", "message": start})
                + sse_event(
                    "content_block_start",
                    {"type": "content_block_start", "index": 0, "content_block": block},
                )
                + delta
            )

        def tail(_cached: int) -> bytes:
            return (
                sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
                + sse_event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason},
                        "usage": usage,
                    },
                )
                + sse_event("message_stop", {"type": "message_stop"})
            )

        await inference.stream(exchange, prompt, output_tokens, token=token, tail=tail)


def _message(message_id: str, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
    }


@contextlib.contextmanager
def _anthropic_errors() -> Iterator[None]:
    """The endpoint's refusals in Anthropic's shape (vLLM's `translate_error_response`),
    status and type kept."""
    try:
        yield
    except ClientError as error:
        error.shape = Shape.ANTHROPIC
        raise
