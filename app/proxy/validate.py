"""Request validation: a parsed JSON body in, an `InvalidRequest` naming the param out. Pure.

Only what Sluice itself relies on is checked here (shapes it reads or that a backend would
reject anyway); unknown fields pass through to the backend untouched.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class InvalidRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return payload


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_common(body: dict[str, Any]) -> None:
    model = body.get("model")
    if model is None:
        raise InvalidRequest(
            "you must provide a model parameter", "model", "missing_required_parameter"
        )
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", "model", "invalid_type")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", "stream", "invalid_type")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options", "invalid_type")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            raise InvalidRequest(f"'{name}' must be a positive integer", name, "invalid_value")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and not _is_number(value):
            raise InvalidRequest(f"'{name}' must be a number", name, "invalid_type")
    stop = body.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise InvalidRequest("'stop' must be a string or a list of strings", "stop", "invalid_type")


def check_chat(body: dict[str, Any]) -> None:
    _check_common(body)
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest(
            "you must provide a messages parameter", "messages", "missing_required_parameter"
        )
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' must be an array", "messages", "invalid_type")
    if not messages:
        raise InvalidRequest("'messages' must not be empty", "messages", "invalid_value")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"'{where}' must be an object", where, "invalid_type")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(
                f"'{where}.role' must be a string", f"{where}.role", "invalid_type"
            )
        if role not in ROLES:
            raise InvalidRequest(
                f"'{where}.role' is {role!r}; expected one of {', '.join(sorted(ROLES))}",
                f"{where}.role",
                "invalid_value",
            )
        _check_content(message.get("content"), f"{where}.content", role)


def _check_content(content: Any, where: str, role: str) -> None:
    if content is None:
        if role in ("assistant", "function"):
            return
        raise InvalidRequest(f"'{where}' is required for role {role!r}", where, "invalid_value")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(
            f"'{where}' must be a string or an array of parts", where, "invalid_type"
        )
    for index, part in enumerate(content):
        part_where = f"{where}[{index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(
                f"'{part_where}' must be an object with a string 'type'", part_where, "invalid_type"
            )
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"'{part_where}.text' must be a string", f"{part_where}.text", "invalid_type"
            )


def check_completion(body: dict[str, Any]) -> None:
    _check_common(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest(
            "you must provide a prompt parameter", "prompt", "missing_required_parameter"
        )
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(_is_int(t) and t >= 0 for t in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return
    raise InvalidRequest(
        "'prompt' must be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
        "prompt",
        "invalid_type",
    )
