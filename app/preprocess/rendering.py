"""The render stage: a checked request whose model is resolved, turned into its prompt. Pure
and picklable: it runs on the event loop and in render worker processes alike.

`resolve` looks up what the served model's requests need (its `RenderSpec`, its window) and
rewrites the body to name it when the client sent an alias or none; `render` makes the
prompt: a chat rendered by the model's template, a completion's text or ids (checked against
the model's vocabulary). `keep_head` is for a render worker's prompt far longer than the
window: only its head crosses the pipe back (sending 12 MB costs the loop milliseconds of
unpickling; proving it too long needs about four characters per token of the window), and
the whole prompt is set aside in a file for the rare prompt dense enough to fit after all.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from app.errors import ClientError
from app.models import ModelDirectory
from app.preprocess.chat_template import ChatTemplate, RenderCost
from app.preprocess.json_bodies import nested_too_deeply
from app.preprocess.length_gate import cut_before_whitespace, head_chars, too_many_bytes
from app.preprocess.request_bodies import ROUTING_RENDERS, ParsedRequest

RENDER_ON_LOOP_BUDGET = 1e-3  # seconds a render may hold the event loop
PROMPT_FILE_PREFIX = "sluice-prompt-"


@dataclass(frozen=True)
class RenderSpec:
    """How one model's requests are rendered, and what a render costs."""

    template: ChatTemplate | None  # None: no chat template, only completions work
    tokenizer_source: str  # named in the error when a chat request has no template
    vocab_size: int  # token ids at or above are refused
    cost: RenderCost | None = None  # None: no template, nothing to render
    max_token_bytes: int | None = None  # the byte bound of length_gate.py (None: no bound)


@dataclass(slots=True)
class RenderPlan:
    """How to render any body: its model's spec (`by_model`, else `default`) and window.
    Pickled with each job: the specs it shares are pickled once."""

    default: RenderSpec
    by_model: Mapping[str, RenderSpec]
    models: ModelDirectory | None  # None: the model is only required, not resolved
    allowed: frozenset[str] | None  # served names the caller's key may use; None: any
    window: int | None = None  # without a directory: the context window of every request


@dataclass(slots=True)
class ResolvedRequest:
    """A checked request whose model is known: what rendering it needs."""

    parsed: ParsedRequest
    model: str | None  # the served model (None: not resolved, no directory)
    spec: RenderSpec
    window: int | None  # the model's context window, where known
    body: bytes | None  # the body to forward when its model was rewritten; None: the client's

    def render_estimate(self) -> float:
        """Seconds its render is expected to take (0 without messages: nothing to render)."""
        cost = self.spec.cost
        if not self.parsed.messages or cost is None:
            return 0.0
        return cost.estimate(len(self.parsed.messages), self.parsed.content_chars)


@dataclass(slots=True)
class RenderedRequest:
    """The prompt of one request, and what the stages after rendering need of it."""

    model: str | None  # the served model (None: not resolved)
    fields: dict[str, Any]  # the request's top-level fields, but the prompt's own
    prompt: str | list[int]  # the rendered chat prompt, the completion text, or given ids
    prompt_chars: int  # characters of the whole prompt (of a text prompt)
    prompt_bytes: int  # its UTF-8 bytes
    messages: int  # chat messages rendered (0 for completions)
    template_seconds: float  # the render alone, without parsing or checks
    completion_tokens: int  # what the request asks for the completion
    window: int | None  # the model's context window, where known
    body: bytes | None  # the body to forward when its model was rewritten; None: the client's
    complete: bool = True  # False when `prompt` is only the head of the text (keep_head)
    # Where the whole prompt waits when only its head is here and it may fit its window.
    whole_at: str | None = None


def resolve(parsed: ParsedRequest, model: str | None, plan: RenderPlan) -> ResolvedRequest:
    """What rendering `model`'s requests needs, and the body rewritten to name the served
    model when the client sent an alias or none."""
    spec, window = plan.default, plan.window
    rewritten: bytes | None = None
    if model is not None:
        as_model = plan.models.prepared_as(model) if plan.models is not None else model
        spec = plan.by_model.get(model) or plan.by_model.get(as_model, plan.default)
        window = plan.models.windows.get(model) if plan.models is not None else None
        # An upload's form is forwarded as it came: the engine knows its names too.
        if parsed.model != model and parsed.kind != "form":
            parsed.fields["model"] = model  # what a body built from the fields must name
            try:
                # ASCII escapes: a lone surrogate the client sent stays valid JSON.
                payload = {**parsed.payload, "model": model}
                rewritten = json.dumps(payload, separators=(",", ":")).encode()
            except RecursionError:
                raise nested_too_deeply() from None
    return ResolvedRequest(parsed, model, spec, window, rewritten)


def render(resolved: ResolvedRequest) -> RenderedRequest:
    """The prompt, whole: a chat rendered by its model's template, a completion's text or
    token ids."""
    parsed, spec = resolved.parsed, resolved.spec
    prompt: str | list[int] = parsed.prompt
    seconds = 0.0
    if parsed.kind in ROUTING_RENDERS:
        # Rendered for routing and counting only: the engine renders it itself, so a template
        # that cannot render it leaves the request without a prompt, not refused.
        template = spec.template
        started = time.perf_counter()
        try:
            if template is not None:
                prompt = template.render(parsed.messages, **parsed.template_arguments)
        except ClientError:
            prompt = ""
        seconds = time.perf_counter() - started
    elif parsed.kind == "chat":
        template = spec.template
        if template is None:
            raise ClientError(
                f"no chat template is configured for tokenizer {spec.tokenizer_source}; the "
                f"server must be started with --chat-template (or use /v1/completions)",
                None,
                "no_chat_template",
            )
        started = time.perf_counter()
        prompt = template.render(parsed.messages, **parsed.template_arguments)
        seconds = time.perf_counter() - started
    elif isinstance(prompt, list) and (min(prompt) < 0 or max(prompt) >= spec.vocab_size):
        bad = min(prompt) if min(prompt) < 0 else max(prompt)
        raise ClientError(
            f"token id {bad} in prompt is outside the vocabulary (0..{spec.vocab_size - 1})",
            "prompt",
            "invalid_prompt",
        )
    chars = size = 0
    if isinstance(prompt, str):
        # Lone surrogates (valid JSON, invalid Unicode) count three bytes; the tokenizer
        # refuses them later with a clear message.
        chars, size = len(prompt), len(prompt.encode("utf-8", "surrogatepass"))
    return RenderedRequest(
        model=resolved.model,
        fields=parsed.fields,
        prompt=prompt,
        prompt_chars=chars,
        prompt_bytes=size,
        messages=len(parsed.messages),
        template_seconds=seconds,
        completion_tokens=parsed.completion_tokens,
        window=resolved.window,
        body=resolved.body,
    )


def keep_head(rendered: RenderedRequest, spec: RenderSpec, *, judged: bool) -> RenderedRequest:
    """A render worker's answer: a text prompt longer than proving it too long for its
    window needs is cut to its head (before whitespace). Unless its bytes alone prove it too
    long, or it is not `judged` by the window at all (rendered only to route it), the whole
    is written to a file (`whole_at`) for the loop to read back should it fit after all."""
    prompt, window = rendered.prompt, rendered.window
    if not isinstance(prompt, str) or window is None:
        return rendered
    cut = cut_before_whitespace(prompt, 0, head_chars(window))
    if cut == len(prompt):
        return rendered
    head = replace(rendered, prompt=prompt[:cut], complete=False)
    budget = window - rendered.completion_tokens
    if not judged or too_many_bytes(rendered.prompt_bytes, budget, spec.max_token_bytes):
        return head
    descriptor, path = tempfile.mkstemp(prefix=PROMPT_FILE_PREFIX)
    try:
        view = memoryview(prompt.encode("utf-8", "surrogatepass"))
        while view:
            view = view[os.write(descriptor, view) :]
    except BaseException:
        os.close(descriptor)
        os.unlink(path)
        raise
    os.close(descriptor)
    head.whole_at = path
    return head


def warm_up(specs: Sequence[RenderSpec]) -> None:
    """Run once in each new worker: import everything and compile every model's template."""
    for spec in specs:
        if spec.template is not None:
            spec.template.render(
                [{"role": "user", "content": "warm up"}], add_generation_prompt=True
            )
