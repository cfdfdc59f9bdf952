"""OpenAI's Responses API as vLLM serves it: requests, the response object, its events. Pure.

After vllm/entrypoints/openai/responses (protocol.py, serving.py, streaming_events.py): the
input becomes chat messages the way vLLM's `construct_input_messages` builds them (the
instructions as a system message, then a previous response's stored messages and its output
as assistant turns, then the new input), and the answer is one assistant message item. A
stream is `event: <type>` + `data:` pairs: response.created, response.in_progress, then at
the first token response.output_item.added and response.content_part.added, a
response.output_text.delta per token, and response.output_text.done,
response.content_part.done, response.output_item.done and response.completed, each with a
rising `sequence_number`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.sim.generation import sse_event
from app.sim.openai_format import request_error
from app.sim.tokens import message_text

# (role, text): the conversation kept with a stored response, in containers the garbage
# collector stops tracking (tuples of strings), so ten thousand of them cost a full
# collection nothing.
Turn = tuple[str, str]
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass(frozen=True)
class ResponsesRequest:
    payload: dict[str, Any]
    input_turns: tuple[Turn, ...]
    instructions: str | None
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    max_output_tokens: int | None


def parse_responses_request(payload: dict[str, Any]) -> ResponsesRequest:
    """What vLLM validates: the input's shape, the flags' types, background only if stored."""
    stream = _flag(payload, "stream", False)
    store = _flag(payload, "store", True)
    background = _flag(payload, "background", False)
    if background and not store:
        raise request_error("background can only be used when `store` is true", param="background")
    instructions = _optional_str(payload, "instructions")
    previous = _optional_str(payload, "previous_response_id")
    limit = payload.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise request_error(
            "`max_output_tokens` must be a positive integer", param="max_output_tokens"
        )
    return ResponsesRequest(
        payload=payload,
        input_turns=input_turns(payload.get("input")),
        instructions=instructions,
        stream=stream,
        store=store,
        background=background,
        previous_response_id=previous,
        max_output_tokens=limit,
    )


def input_turns(value: Any) -> tuple[Turn, ...]:
    """A string (one user turn) or a list of input items (messages, function calls and
    their outputs; reasoning items are skipped, as vLLM skips them)."""
    if isinstance(value, str):
        return (("user", value),)
    if not isinstance(value, list):
        raise request_error("`input` must be a string or a list of input items", param="input")
    turns: list[Turn] = []
    for item in value:
        if not isinstance(item, dict):
            raise request_error("every input item must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise request_error("a message item needs a `role`", param="input")
            turns.append((role, _content_text(item.get("content"))))
        elif kind == "function_call":
            turns.append(("assistant", f"{item.get('name')}({item.get('arguments', '')})"))
        elif kind == "function_call_output":
            turns.append(("tool", str(item.get("output", ""))))
        elif kind != "reasoning":
            raise request_error(f"Unsupported input item type: {kind!r}", param="input")
    return tuple(turns)


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        parts = [part for part in content if isinstance(part, dict)]
        if len(parts) != len(content):
            raise request_error("message content parts must be objects", param="input")
        return "".join(
            str(part.get("text", "")) for part in parts if part.get("type") in _TEXT_PARTS
        )
    try:
        return message_text(content)
    except ValueError as exc:
        raise request_error(str(exc), param="input") from None


def conversation(
    request: ResponsesRequest, previous: tuple[Turn, ...], previous_output: str | None
) -> tuple[Turn, ...]:
    """vLLM's order: new instructions, the previous turns, the previous answer, the input."""
    turns: list[Turn] = []
    if request.instructions:
        turns.append(("system", request.instructions))
    turns.extend(previous)
    if previous_output:  # none while a background response has not finished
        turns.append(("assistant", previous_output))
    turns.extend(request.input_turns)
    return tuple(turns)


def as_messages(turns: Sequence[Turn]) -> list[dict[str, Any]]:
    return [{"role": role, "content": text} for role, text in turns]


def output_text(response: dict[str, Any]) -> str:
    """The text of a response's message items (what a follow-up sees as the answer)."""
    return "".join(
        part.get("text", "")
        for item in response.get("output", ())
        if item.get("type") == "message"
        for part in item.get("content", ())
    )


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def response_object(
    request: ResponsesRequest,
    *,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    max_output_tokens: int,
) -> dict[str, Any]:
    """The fields of vLLM's `ResponsesResponse.from_request`, echoing the request."""
    payload = request.payload
    return {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": None,
        "instructions": request.instructions,
        "metadata": payload.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": payload.get("parallel_tool_calls", True),
        "temperature": payload.get("temperature") or 1.0,
        "tool_choice": payload.get("tool_choice", "auto"),
        "tools": payload.get("tools") or [],
        "top_p": payload.get("top_p") or 1.0,
        "background": request.background,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": payload.get("max_tool_calls"),
        "previous_response_id": request.previous_response_id,
        "prompt": None,
        "reasoning": payload.get("reasoning"),
        "service_tier": payload.get("service_tier") or "auto",
        "status": status,
        "text": payload.get("text"),
        "top_logprobs": payload.get("top_logprobs") or 0,
        "truncation": payload.get("truncation") or "disabled",
        "usage": usage,
        "user": payload.get("user"),
    }


def response_usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


class ResponseEvents:
    """The server-sent events of one streamed response, numbered as they are made."""

    def __init__(self, initial: dict[str, Any], item_id: str) -> None:
        self.initial = initial
        self.item_id = item_id
        self.sequence = 0
        self.pieces: list[str] = []

    def event(self, type_: str, **fields: Any) -> bytes:
        payload = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(type_, payload)

    def head(self) -> bytes:
        return self.event("response.created", response=self.initial) + self.event(
            "response.in_progress", response=self.initial
        )

    def token(self, index: int, piece: str) -> bytes:
        self.pieces.append(piece)
        where = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        opened = b""
        if index == 0:
            opened = self.event(
                "response.output_item.added",
                output_index=0,
                item=message_item(self.item_id, "", "in_progress"),
            ) + self.event("response.content_part.added", **where, part=text_part(""))
        delta = self.event("response.output_text.delta", **where, delta=piece, logprobs=[])
        return opened + delta

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def tail(self, final: dict[str, Any]) -> bytes:
        where = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        text = self.text
        return (
            self.event("response.output_text.done", **where, text=text, logprobs=[])
            + self.event("response.content_part.done", **where, part=text_part(text))
            + self.event(
                "response.output_item.done",
                output_index=0,
                item=message_item(self.item_id, text, "completed"),
            )
            + self.event("response.completed", response=final)
        )


def now() -> int:
    return int(time.time())


def _flag(payload: dict[str, Any], key: str, default: bool) -> bool:
    value = payload.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise request_error(f"`{key}` must be a boolean", param=key)
    return value


def _optional_str(payload: dict[str, Any], key: str) -> str | None:
    value = payload.get(key)
    if value is not None and not isinstance(value, str):
        raise request_error(f"`{key}` must be a string", param=key)
    return value
