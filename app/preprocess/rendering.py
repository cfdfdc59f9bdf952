"""A request body turned into its prompt: parse, check, render. Pure and picklable.

The same function runs on the event loop (small bodies, cheap renders) and in a render worker
process (workers.py) for everything else, so it takes and returns only plain data: the body
bytes, a `RenderSpec` (the chat template by its source, the vocabulary size) and a `Rendered`.

A prompt far longer than the context window does not cross the pipe whole: with `head_chars`
set, only its first `head_chars` characters come back, with the size of the whole, which is
all that proving it too long needs (length_gate.py). Sending 12 MB back costs the loop
milliseconds of unpickling; the proof needs about four characters per token of the window.

Which template renders a body depends on the model it names, which only its parse tells: a
`RenderPlan` carries every model's spec and the `ModelDirectory` to resolve the name with,
so a worker that parses a large body picks its model itself (`render_request`). A request
that named an alias, or no model, leaves with its body rewritten to carry the served name.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.http.errors import ClientError
from app.models import ModelDirectory, missing_model, model_field
from app.preprocess import request_bodies
from app.preprocess.chat_template import ChatTemplate
from app.preprocess.length_gate import cut_before_whitespace, head_chars

Kind = Literal["chat", "completion"]
# The fields that carry a request's prompt; every other field travels in `Rendered.fields`.
PROMPT_FIELDS = {"chat": "messages", "completion": "prompt"}


@dataclass(frozen=True)
class RenderSpec:
    template: ChatTemplate | None  # None: no chat template, only completions work
    tokenizer_source: str  # named in the error when a chat request has no template
    vocab_size: int  # token ids at or above are refused


@dataclass(slots=True)
class Rendered:
    fields: dict[str, Any]  # the request's top-level fields, but the prompt's own
    prompt: str | list[int]  # the rendered chat prompt, the completion text, or given ids
    prompt_chars: int  # characters of the whole prompt (of a text prompt)
    prompt_bytes: int  # its UTF-8 bytes
    complete: bool  # False when `prompt` is only the head of the text
    messages: int  # chat messages rendered (0 for completions)
    template_seconds: float  # the render alone, without parsing or checks


@dataclass(slots=True)
class RenderPlan:
    """How to render any body: its model's spec (`by_model`, else `default`) and how much of
    a long prompt to keep (from the model's window). Pickled with each job: the specs it
    shares are pickled once."""

    default: RenderSpec
    by_model: Mapping[str, RenderSpec]
    models: ModelDirectory | None  # None: the model is only required, not resolved
    allowed: frozenset[str] | None  # served names the caller's key may use; None: any
    window: int | None = None  # without a directory: the context window of every request
    cut_heads: bool = True  # False: the whole prompt, however long

    def pick(self, payload: dict[str, Any]) -> tuple[str | None, RenderSpec, int | None]:
        """The served model, its spec and the head to keep; a ClientError for a model that
        cannot be served (404) or a `model` field of the wrong shape (400)."""
        requested = payload.get("model")
        model: str | None = None
        spec, window = self.default, self.window
        if self.models is None:
            if model_field(requested) is None:
                raise missing_model()
        else:
            model = self.models.resolve(requested, self.allowed)
            spec, window = self.by_model.get(model, self.default), self.models.windows.get(model)
        head = head_chars(window) if window is not None and self.cut_heads else None
        return model, spec, head


@dataclass(slots=True)
class RenderedRequest:
    model: str | None  # the served model (None: not resolved)
    rendered: Rendered
    body: bytes | None  # the body to forward when its model was rewritten; None: the client's


def render_request(kind: Kind, body: bytes, plan: RenderPlan) -> RenderedRequest:
    """Parse, resolve the model and render a raw body: the job a render worker runs."""
    payload = request_bodies.parse_json_object(body)
    model, spec, head = plan.pick(payload)
    return render_picked(kind, payload, model, spec, head)


def render_picked(
    kind: Kind, payload: dict[str, Any], model: str | None, spec: RenderSpec, head: int | None
) -> RenderedRequest:
    """Render a parsed body whose model was picked; rewrite its `model` to the served name
    when the client sent an alias or nothing."""
    rewritten = None
    if model is not None and payload.get("model") != model:
        payload["model"] = model
        rewritten = encode_body(payload)
    return RenderedRequest(model, render_payload(kind, payload, spec, head), rewritten)


def encode_body(payload: dict[str, Any]) -> bytes:
    try:
        # ASCII escapes: a lone surrogate the client sent stays valid JSON on the way out.
        return json.dumps(payload, separators=(",", ":")).encode()
    except RecursionError:
        raise request_bodies.nested_too_deeply() from None


def render_payload(
    kind: Kind, payload: dict[str, Any], spec: RenderSpec, head_chars: int | None
) -> Rendered:
    fields = payload.copy()
    fields.pop(PROMPT_FIELDS[kind], None)
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


def warm_up(specs: Sequence[RenderSpec]) -> None:
    """Run once in each new worker: import everything and compile every model's template."""
    for spec in specs:
        if spec.template is not None:
            spec.template.render(
                [{"role": "user", "content": "warm up"}], add_generation_prompt=True
            )
