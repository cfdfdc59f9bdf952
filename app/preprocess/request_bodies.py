"""The first stages of a request body's walk: parse it and check its shape (`parse_request`),
handing the next stage a `ParsedRequest`. Pure; every refusal is a `ClientError` naming its
param.

Only what Sluice relies on is checked (shapes it reads, or that a backend would reject
anyway); unknown fields pass through to the backend untouched. The model a request names is
only checked to be a string here: resolving it is the next stage (rendering.py). The same
functions serve the proxy, the render worker processes (which parse large bodies off the
event loop) and the simulated backend (`parse_json_object`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from app.errors import ClientError
from app.preprocess.conversations import content_chars, messages_messages, responses_messages
from app.preprocess.forms import form_fields
from app.preprocess.json_bodies import parse_json_object

# How a body is read: a chat, a completion, a Responses or Messages conversation (rendered
# like a chat, for routing), a JSON body with only a model to route by (embeddings, rerank,
# score...), or a multipart form (an audio upload).
Kind = Literal["chat", "completion", "responses", "messages", "model", "form"]
# The fields that carry a request's prompt; every other field travels in `fields`.
PROMPT_FIELDS = {
    "chat": "messages",
    "completion": "prompt",
    "responses": "input",
    "messages": "messages",
}
# Kinds rendered as a chat for routing and counting only: the engine renders them itself, so a
# render that fails or a prompt over the window is not Sluice's to refuse.
ROUTING_RENDERS = frozenset({"responses", "messages"})

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Keys a request's chat_template_kwargs may not override: the template's own inputs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"}
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(slots=True)
class ParsedRequest:
    """A body parsed and its shape checked: what resolving its model and rendering read."""

    kind: Kind
    payload: dict[str, Any]  # the body as parsed: forwarded again if its model is rewritten
    fields: dict[str, Any]  # its fields but the prompt's
    model: str | None  # the model it names, as named (None: it names none)
    messages: list[dict[str, Any]]  # chat: content flattened to text (vLLM's way); else []
    prompt: str | list[int]  # completion: its text or token ids; chat: ""
    template_arguments: dict[str, Any]  # chat: what the template gets besides the messages
    content_chars: int  # characters of the messages' content (what a render copies)
    completion_tokens: int  # what it asks for the completion (max_completion_tokens, ...)


def parse_request(kind: Kind, body: bytes) -> ParsedRequest:
    """Parse and check one body; a `ClientError` naming what is wrong."""
    payload: dict[str, Any] = dict(form_fields(body)) if kind == "form" else parse_json_object(body)
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError("'model' must be a string", "model", "invalid_type")
    fields = payload.copy()
    fields.pop(PROMPT_FIELDS.get(kind, ""), None)
    if kind in ("model", "form"):
        return ParsedRequest(kind, payload, fields, model, [], "", {}, 0, 0)
    if kind == "completion":
        check_completion(payload)
        prompt = _completion_prompt(payload)
        return ParsedRequest(
            kind, payload, fields, model, [], prompt, {}, 0, requested_completion_tokens(payload)
        )
    arguments: dict[str, Any]
    if kind in ROUTING_RENDERS:
        _check_common(payload)
        if kind == "responses":
            messages, budget = responses_messages(payload), payload.get("max_output_tokens")
        else:
            messages, budget = messages_messages(payload), payload.get("max_tokens")
        chars = content_chars(messages)
        arguments = {"add_generation_prompt": True, "tools": None, "documents": None, "extra": {}}
        wanted = budget if isinstance(budget, int) and not isinstance(budget, bool) else 0
        completion = max(wanted, 0)
    else:
        check_chat(payload)
        messages, chars = template_messages(payload["messages"])
        arguments = {
            "add_generation_prompt": _add_generation_prompt(payload),
            "tools": payload.get("tools"),
            "documents": payload.get("documents"),
            "extra": _template_extras(payload),
        }
        completion = requested_completion_tokens(payload)
    return ParsedRequest(kind, payload, fields, model, messages, "", arguments, chars, completion)


def _check_common(body: dict[str, Any]) -> None:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ClientError("'stream' must be a boolean", "stream", "invalid_type")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ClientError("'stream_options' must be an object", "stream_options", "invalid_type")
    priority = body.get("priority")
    if priority is not None and not _is_int(priority):
        raise ClientError("'priority' must be an integer", "priority", "invalid_type")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            raise ClientError(f"'{name}' must be a positive integer", name, "invalid_value")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and not _is_number(value):
            raise ClientError(f"'{name}' must be a number", name, "invalid_type")
    stop = body.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise ClientError("'stop' must be a string or a list of strings", "stop", "invalid_type")


def _required(body: dict[str, Any], name: str) -> Any:
    value = body.get(name)
    if value is None:
        raise ClientError(
            f"you must provide a {name} parameter", name, "missing_required_parameter"
        )
    return value


def check_chat(body: dict[str, Any]) -> None:
    _check_common(body)
    messages = _required(body, "messages")
    if not isinstance(messages, list):
        raise ClientError("'messages' must be an array", "messages", "invalid_type")
    if not messages:
        raise ClientError("'messages' must not be empty", "messages", "invalid_value")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ClientError(f"'{where}' must be an object", where, "invalid_type")
        role = message.get("role")
        if not isinstance(role, str):
            raise ClientError(f"'{where}.role' must be a string", f"{where}.role", "invalid_type")
        if role not in ROLES:
            raise ClientError(
                f"'{where}.role' is {role!r}; expected one of {', '.join(sorted(ROLES))}",
                f"{where}.role",
                "invalid_value",
            )
        _check_content(message.get("content"), f"{where}.content", role)


def _check_content(content: Any, where: str, role: str) -> None:
    if content is None:
        if role in ("assistant", "function"):
            return
        raise ClientError(f"'{where}' is required for role {role!r}", where, "invalid_value")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ClientError(f"'{where}' must be a string or an array of parts", where, "invalid_type")
    for index, part in enumerate(content):
        part_where = f"{where}[{index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ClientError(
                f"'{part_where}' must be an object with a string 'type'", part_where, "invalid_type"
            )
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise ClientError(
                f"'{part_where}.text' must be a string", f"{part_where}.text", "invalid_type"
            )


def check_completion(body: dict[str, Any]) -> None:
    _check_common(body)
    prompt = _required(body, "prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(_is_int(t) and t >= 0 for t in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return
    raise ClientError(
        "'prompt' must be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
        "prompt",
        "invalid_type",
    )


def template_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Checked messages with content flattened to a string (or None), and their characters.

    Text parts are joined with newlines, as vLLM does for templates that expect string
    content. Other parts (images, audio, files) are refused: Sluice renders text-only prompts.
    """
    flattened = []
    chars = 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, i)
        chars += len(content) if content else 0
        flattened.append({**message, "content": content})
    return flattened, chars


def _join_text_parts(parts: list[dict[str, Any]], index: int) -> str:
    for j, part in enumerate(parts):
        if part["type"] != "text":
            param = f"messages[{index}].content[{j}]"
            raise ClientError(
                f"{param}: content parts of type {part['type']!r} are not supported; this proxy "
                f"renders text-only prompts (use parts of type 'text')",
                param,
                "unsupported_content",
            )
    return "\n".join(part["text"] for part in parts)


def _template_extras(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ClientError(
            "chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type"
        )
    clash = RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
    if clash:
        raise ClientError(
            f"chat_template_kwargs may not set {sorted(clash)}; pass them as request fields",
            "chat_template_kwargs",
            "invalid_value",
        )
    return dict(kwargs)


def _add_generation_prompt(body: dict[str, Any]) -> bool:
    value = body.get("add_generation_prompt", True)
    if not isinstance(value, bool):
        raise ClientError(
            "add_generation_prompt must be a boolean", "add_generation_prompt", "invalid_type"
        )
    return value


def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """The one prompt of a checked completions request: its text, or its token ids (checked
    against the model's vocabulary once the model is known)."""
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if all(_is_int(t) for t in prompt):
        if not prompt:
            raise ClientError("prompt must not be empty", "prompt", "invalid_prompt")
        return list(prompt)
    raise ClientError(
        f"batched prompts ({len(prompt)}) are not supported; send one prompt per request",
        "prompt",
        "unsupported_batch",
    )


def requested_completion_tokens(body: dict[str, Any]) -> int:
    """The completion budget a request asks for (max_completion_tokens, then max_tokens)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int and value >= 0:
            return value
    return 0
