"""Turning request bodies into what templates and the tokenizer take, or a PreprocessError.

The proxy has already checked the basic shape (messages is a non-empty list of objects with
a known string role); this module checks what only preprocessing cares about: content parts,
tool arguments, completion prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.preprocess.errors import PreprocessError

# Keys a request's chat_template_kwargs may not override: the template's own inputs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"}
)


def template_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Messages with content flattened to a string (or None), and their total characters.

    Content may be a string or a list of parts; text parts are joined with newlines, as vLLM
    does for templates that expect string content. Non-text parts (images, audio, files) are
    refused: Sluice renders text-only prompts.
    """
    flattened = []
    chars = 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, i)
        elif content is not None and not isinstance(content, str):
            raise PreprocessError(
                f"messages[{i}].content must be a string, a list of content parts or null",
                f"messages[{i}].content",
                "invalid_content",
            )
        chars += len(content) if content else 0
        flattened.append({**message, "content": content})
    return flattened, chars


def _join_text_parts(parts: list[Any], index: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        param = f"messages[{index}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise PreprocessError(
                f"{param}: content parts of type {kind!r} are not supported; this proxy "
                f"renders text-only prompts (use parts of type 'text')",
                param,
                "unsupported_content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise PreprocessError(
                f"{param}.text must be a string", f"{param}.text", "invalid_content"
            )
        texts.append(text)
    return "\n".join(texts)


def template_extras(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise PreprocessError(
            "chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type"
        )
    clash = RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
    if clash:
        raise PreprocessError(
            f"chat_template_kwargs may not set {sorted(clash)}; pass them as request fields",
            "chat_template_kwargs",
            "invalid_value",
        )
    return dict(kwargs)


def add_generation_prompt(body: dict[str, Any]) -> bool:
    value = body.get("add_generation_prompt", True)
    if not isinstance(value, bool):
        raise PreprocessError(
            "add_generation_prompt must be a boolean", "add_generation_prompt", "invalid_type"
        )
    return value


def completion_prompt(body: dict[str, Any], vocab_size: int) -> str | list[int]:
    """The one prompt of a completions request: its text, or its token ids (checked)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return _checked_ids(prompt, vocab_size)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise PreprocessError(
            f"batched prompts ({len(prompt)}) are not supported; send one prompt per request",
            "prompt",
            "unsupported_batch",
        )
    raise PreprocessError(
        "prompt must be a string or a list of token ids", "prompt", "invalid_prompt"
    )


def _checked_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    if not ids:
        raise PreprocessError("prompt must not be empty", "prompt", "invalid_prompt")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise PreprocessError(
            f"token id {bad} in prompt is outside the vocabulary (0..{vocab_size - 1})",
            "prompt",
            "invalid_prompt",
        )
    return list(ids)


def requested_completion_tokens(body: dict[str, Any]) -> int:
    """The completion budget a request asks for (max_completion_tokens, then max_tokens)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int and value >= 0:
            return value
    return 0
