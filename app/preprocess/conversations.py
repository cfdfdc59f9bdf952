"""The conversations of OpenAI's Responses API and Anthropic's Messages API, read as chat
messages so that the model's chat template renders them: the prompt's prefix routes them to
the engine that holds it in its KV cache, and its tokens count as a chat's would. Pure.

Only what rendering and routing need is read, and leniently: the engine, which renders these
bodies itself, is the judge of what it accepts. Text parts become the message's text; parts
with no text (images, files, tool calls) are left out of the rendered prompt, which is only a
key for routing here: the body is forwarded as the client sent it. What a request cannot be
without (Responses' `input`, Messages' `messages` and `max_tokens`) is refused with a 400
naming it, as the engine would.
"""

from __future__ import annotations

from typing import Any

from app.errors import ClientError

# Responses' input item and content types whose text is part of the conversation.
RESPONSES_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
MESSAGES_ROLES = frozenset({"user", "assistant"})


def responses_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` as a system message, then `input` (a string, or a list of items)."""
    messages: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ClientError("'instructions' must be a string", "instructions", "invalid_type")
        messages.append({"role": "system", "content": instructions})
    items = payload.get("input")
    if items is None:
        raise ClientError(
            "you must provide an input parameter", "input", "missing_required_parameter"
        )
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list):
        raise ClientError("'input' must be a string or an array of items", "input", "invalid_type")
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise ClientError(
                f"'input[{index}]' must be an object", f"input[{index}]", "invalid_type"
            )
        message = _responses_item(item)
        if message is not None:
            messages.append(message)
    return messages


def _responses_item(item: dict[str, Any]) -> dict[str, Any] | None:
    kind = item.get("type", "message")
    if kind == "message" and isinstance(item.get("role"), str):
        return {
            "role": item["role"],
            "content": _text_of(item.get("content"), RESPONSES_TEXT_PARTS),
        }
    if kind == "function_call_output" and isinstance(item.get("output"), str):
        return {"role": "tool", "content": item["output"]}
    return None  # tool calls, reasoning, references to items: nothing of the prompt's text


def messages_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's `system` (a string or text blocks) as a system message, then `messages`."""
    max_tokens = payload.get("max_tokens")
    if max_tokens is None:
        raise ClientError(
            "you must provide a max_tokens parameter", "max_tokens", "missing_required_parameter"
        )
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ClientError("'max_tokens' must be a positive integer", "max_tokens", "invalid_value")
    messages: list[dict[str, Any]] = []
    system = payload.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, frozenset({"text"}))})
    turns = payload.get("messages")
    if not isinstance(turns, list) or not turns:
        raise ClientError("'messages' must be a non-empty array", "messages", "invalid_value")
    for index, turn in enumerate(turns):
        where = f"messages[{index}]"
        if not isinstance(turn, dict) or turn.get("role") not in MESSAGES_ROLES:
            raise ClientError(
                f"'{where}' must be an object whose role is user or assistant",
                where,
                "invalid_value",
            )
        content = turn.get("content")
        text = _text_of(content, frozenset({"text"}))
        if isinstance(content, list):
            # Tool results carry text the model reads: theirs is part of the prompt too.
            text += "".join(
                _text_of(block.get("content"), frozenset({"text"}))
                for block in content
                if isinstance(block, dict) and block.get("type") == "tool_result"
            )
        messages.append({"role": turn["role"], "content": text})
    return messages


def _text_of(content: Any, text_parts: frozenset[str]) -> str:
    """A string, or the text of a list of parts whose type carries text, joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(
        part["text"]
        for part in content
        if isinstance(part, dict)
        and part.get("type") in text_parts
        and isinstance(part.get("text"), str)
    )


def content_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(message["content"]) for message in messages)
