"""The shipped chat templates (chat_templates/*.jinja) as plain Python, for the messages most
requests carry: text turns of the system, the user and the assistant.

Jinja2 is pure Python that builds a context, a namespace and a loop object for every render:
9.5 µs for a one-message DeepSeek-V3 chat and 108 µs for 64 messages here, against 0.3 and
9.6 µs for the same string built directly; 4.9 ms against 0.18 for 1,000 messages of ~100
tokens, 0.8 against 0.02 ms for one of 100k (`python -m load bench templating`). Each part
goes into one join, so a long prompt is copied once. For one-token chats the proxy's CPU a
request fell from 0.228 to 0.206 ms (`python -m load compare`, 32 clients).

Each function returns exactly what its template renders, or None for anything it does not
take (tool calls, tool outputs, other roles, content that is not a string), which Jinja then
renders as before; tests render generated conversations both ways and compare. The .jinja
files stay the definition: a template given as a file with the same text renders here too.

A render function takes the messages (dicts, content already flattened to a string or None,
as `request_bodies.template_messages` gives them), the `add_generation_prompt` flag and the
BOS token. A key the template reads but a message lacks is undefined to Jinja: falsy, so
`content or ''` is empty, and an error when added to a string; the functions follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DirectRender = Callable[[list[dict[str, Any]], bool, str], str | None]

_DEEPSEEK_USER = "<｜User｜>"  # noqa: RUF001 - DeepSeek's bars are fullwidth
_DEEPSEEK_ASSISTANT = "<｜Assistant｜>"  # noqa: RUF001
_DEEPSEEK_END = "<｜end▁of▁sentence｜>"  # noqa: RUF001


def deepseek_v3(
    messages: list[dict[str, Any]], add_generation_prompt: bool, bos: str
) -> str | None:
    system: list[str] = []
    turns: list[str] = []
    for message in messages:
        content = message.get("content")
        if type(content) is not str:
            return None
        role = message.get("role")
        if role == "user":
            turns += (_DEEPSEEK_USER, content)
        elif role == "assistant":
            if message.get("tool_calls"):
                return None
            turns += (_DEEPSEEK_ASSISTANT, content, _DEEPSEEK_END)
        elif role == "system":
            system.append(content)
        else:
            return None
    if add_generation_prompt:
        turns.append(_DEEPSEEK_ASSISTANT)
    return "".join([bos, "\n\n".join(system), *turns])


def llama3(messages: list[dict[str, Any]], add_generation_prompt: bool, bos: str) -> str | None:
    turns = _text_turns(messages)
    if turns is None:
        return None
    parts = [bos]
    for role, content in turns:
        parts += (
            "<|start_header_id|>",
            role,
            "<|end_header_id|>\n\n",
            content.strip(),
            "<|eot_id|>",
        )
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def chatml(messages: list[dict[str, Any]], add_generation_prompt: bool, bos: str) -> str | None:
    turns = _text_turns(messages)
    if turns is None:
        return None
    parts: list[str] = []
    for role, content in turns:
        parts += ("<|im_start|>", role, "\n", content, "<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _text_turns(messages: list[dict[str, Any]]) -> list[tuple[str, str]] | None:
    """Each message's role and content (empty for none: Jinja's `content or ''`), or None
    when either is not a string (Jinja then renders the conversation)."""
    turns = []
    for message in messages:
        content = message.get("content")
        if content is None:
            content = ""
        role = message.get("role")
        if type(content) is not str or type(role) is not str:
            return None
        turns.append((role, content))
    return turns


# By the stem of the template's file in chat_templates/.
BY_NAME: dict[str, DirectRender] = {
    "deepseek_v3": deepseek_v3,
    "llama3": llama3,
    "chatml": chatml,
}
