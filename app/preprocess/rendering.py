"""A request body turned into its prompt: parse, check, render. Pure and picklable.

The same function runs on the event loop (small bodies, cheap renders) and in a render worker
process (workers.py) for everything else, so it takes and returns only plain data: the body
bytes, a `RenderSpec` (the chat template by its source, the vocabulary size) and a `Rendered`.

A prompt far longer than the context window does not cross the pipe whole: with `head_chars`
set, only its first `head_chars` characters come back, with the size of the whole, which is
all that proving it too long needs (length_gate.py). Sending 12 MB back costs the loop
milliseconds of unpickling; the proof needs about four characters per token of the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import ClientError
from app.preprocess import request_bodies
from app.preprocess.chat_template import ChatTemplate
from app.preprocess.length_gate import cut_before_whitespace

Kind = Literal["chat", "completion"]
# The fields that carry a request's prompt; every other field travels in `Rendered.fields`.
PROMPT_FIELDS = {"chat": "messages", "completion": "prompt"}


@dataclass(frozen=True)
class RenderSpec:
    template: ChatTemplate | None  # None: no chat template, only completions work
    tokenizer_source: str  # named in the error when a chat request has no template
    vocab_size: int  # token ids at or above are refused


@dataclass(frozen=True)
class Rendered:
    fields: dict[str, Any]  # the request's top-level fields, but the prompt's own
    prompt: str | list[int]  # the rendered chat prompt, the completion text, or given ids
    prompt_chars: int  # characters of the whole prompt (of a text prompt)
    prompt_bytes: int  # its UTF-8 bytes
    complete: bool  # False when `prompt` is only the head of the text
    messages: int  # chat messages rendered (0 for completions)
    template_seconds: float  # the render alone, without parsing or checks


def render_body(kind: Kind, body: bytes, spec: RenderSpec, head_chars: int | None) -> Rendered:
    """Parse and render a raw body: the job a render worker process runs."""
    return render_payload(kind, request_bodies.parse_json_object(body), spec, head_chars)


def render_payload(
    kind: Kind, payload: dict[str, Any], spec: RenderSpec, head_chars: int | None
) -> Rendered:
    fields = {key: value for key, value in payload.items() if key != PROMPT_FIELDS[kind]}
    if kind == "completion":
        request_bodies.check_completion(payload)
        prompt = request_bodies.completion_prompt(payload, spec.vocab_size)
        return _text_prompt(fields, prompt, 0, 0.0, head_chars)
    request_bodies.check_chat(payload)
    template = spec.template
    if template is None:
        raise ClientError(
            f"no chat template is configured for tokenizer {spec.tokenizer_source}; the "
            f"server must be started with --chat-template (or use /v1/completions)",
            None,
            "no_chat_template",
        )
    messages, _ = request_bodies.template_messages(payload["messages"])
    render_kwargs = render_arguments(payload)
    started = time.perf_counter()
    prompt = template.render(messages, **render_kwargs)
    return _text_prompt(fields, prompt, len(messages), time.perf_counter() - started, head_chars)


def render_arguments(payload: dict[str, Any]) -> dict[str, Any]:
    """What a chat template receives besides the messages."""
    return {
        "add_generation_prompt": request_bodies.add_generation_prompt(payload),
        "tools": payload.get("tools"),
        "documents": payload.get("documents"),
        "extra": request_bodies.template_extras(payload),
    }


def _text_prompt(
    fields: dict[str, Any],
    prompt: str | list[int],
    messages: int,
    template_seconds: float,
    head_chars: int | None,
) -> Rendered:
    if isinstance(prompt, list):
        return Rendered(fields, prompt, 0, 0, True, messages, template_seconds)
    # Lone surrogates (valid JSON, invalid Unicode) count three bytes; the tokenizer refuses
    # them later with a clear message.
    size = len(prompt.encode("utf-8", "surrogatepass"))
    cut = len(prompt) if head_chars is None else cut_before_whitespace(prompt, 0, head_chars)
    if cut == len(prompt):
        return Rendered(fields, prompt, len(prompt), size, True, messages, template_seconds)
    return Rendered(fields, prompt[:cut], len(prompt), size, False, messages, template_seconds)


def warm_up(spec: RenderSpec) -> None:
    """Run once in each new worker: import everything and compile the template."""
    if spec.template is not None:
        spec.template.render([{"role": "user", "content": "warm up"}], add_generation_prompt=True)
