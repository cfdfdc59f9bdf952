"""OpenAI request parsing and response shapes, as vLLM's OpenAI server produces them.

No I/O: bodies come in as bytes and responses leave as dicts, so every shape is testable
without a server. Invalid requests raise `ClientError` (app/errors.py) with vLLM's error
type and code, which the server turns into an OpenAI-shaped error body.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import ClientError
from app.sim.settings import SimSettings
from app.sim.tokens import TextTokenizer, render_chat

Kind = Literal["chat", "completion"]
# How the prompt arrived: chat messages, completion text, or completion token ids (what a
# proxy forwarding tokens sends).
PromptForm = Literal["messages", "text", "token_ids"]


def request_error(
    message: str,
    *,
    status: int = 400,
    type_: str = "BadRequestError",
    param: str | None = None,
    code: str | int | None = 400,
) -> ClientError:
    """An error as vLLM's OpenAI server shapes it: its exception name as type, status as code."""
    return ClientError(message, param, code, status=status, type_=type_)


@dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    prompt_tokens: list[int]
    prompt_form: PromptForm
    output_tokens: int
    # "length" when the client's limit cut the output, "stop" when the sim chose to end it.
    finish_reason: Literal["length", "stop"]
    stream: bool
    include_usage: bool


def answering_model(payload: dict[str, Any], settings: SimSettings) -> str:
    """The model name an answer carries, or vLLM's 404 for a name this engine does not serve.

    As vLLM's `OpenAIModelRegistry.check_model`: no `model` means the first served name, any
    other unserved name is `NotFoundError` 404 with `param` "model". A served name is answered
    under that name, as a LoRA adapter is. With no `--model` the sim answers to any name, unless
    LoRA is on: then a name that is neither the base model nor a loaded adapter is unknown.
    """
    requested = payload.get("model")
    served = settings.served_models
    strict = settings.models or settings.max_loras
    if not strict or not isinstance(requested, str) or not requested:
        return served[0]
    if requested not in served:
        raise request_error(
            f"The model `{requested}` does not exist.",
            status=404,
            type_="NotFoundError",
            param="model",
            code=404,
        )
    return requested


def check_context_length(settings: SimSettings, prompt: int, output: int, where: str) -> None:
    """vLLM's 400 for a prompt and its output that do not fit the context window."""
    requested = prompt + output
    if requested > settings.max_model_len:
        raise request_error(
            f"This model's maximum context length is {settings.max_model_len} tokens. "
            f"However, you requested {requested} tokens ({prompt} in the {where}, "
            f"{output} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            param=where,
            code="context_length_exceeded",
        )


def chat_prompt_text(payload: dict[str, Any]) -> str:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise request_error("`messages` must be a non-empty list", param="messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise request_error("every message needs a string `role`", param="messages")
    try:
        return render_chat(messages)
    except ValueError as exc:
        raise request_error(str(exc), param="messages") from None


def completion_prompt_tokens(
    payload: dict[str, Any], tokenizer: TextTokenizer
) -> tuple[list[int], PromptForm]:
    """A string, a one-string list, a token-id list, or a one-token-id-list list."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), "text"
    if isinstance(prompt, list) and prompt and all(_is_int(token) for token in prompt):
        out_of_range = [token for token in prompt if not 0 <= token < tokenizer.vocab_size]
        if out_of_range:
            raise request_error(f"Token id {out_of_range[0]} is out of vocabulary", param="prompt")
        return list(prompt), "token_ids"
    raise request_error(
        "`prompt` must be a string, a list of one string, or a non-empty list of token ids",
        param="prompt",
    )


def parse_generation(
    kind: Kind, payload: dict[str, Any], tokenizer: TextTokenizer, settings: SimSettings
) -> GenerationRequest:
    form: PromptForm
    if kind == "chat":
        prompt, form = tokenizer.encode(chat_prompt_text(payload)), "messages"
        limit = _optional_positive_int(payload, "max_completion_tokens")
        if limit is None:
            limit = _optional_positive_int(payload, "max_tokens")
    else:
        prompt, form = completion_prompt_tokens(payload, tokenizer)
        limit = _optional_positive_int(payload, "max_tokens")
    output_tokens = settings.default_max_tokens if limit is None else limit
    where = "messages" if kind == "chat" else "prompt"
    check_context_length(settings, len(prompt), output_tokens, where)

    stream = payload.get("stream", False)
    options = payload.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise request_error("`stream` must be a boolean and `stream_options` an object")
    return GenerationRequest(
        kind=kind,
        prompt_tokens=prompt,
        prompt_form=form,
        output_tokens=output_tokens,
        finish_reason="stop" if limit is None else "length",
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


class ResponseShapes:
    """The bodies and stream chunks of one response, sharing its id, timestamp and model."""

    def __init__(self, kind: Kind, model: str) -> None:
        self.kind = kind
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def response(
        self,
        text: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
            }
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        return self._envelope(
            "chat.completion" if self.kind == "chat" else "text_completion",
            [choice],
            usage=usage(prompt_tokens, completion_tokens, cached_tokens),
        )

    def role_chunk(self) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def token_chunk(self, piece: str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": piece}}
            if self.kind == "chat"
            else {"index": 0, "text": piece}
        )
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        return self._chunk([choice])

    def usage_chunk(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int
    ) -> dict[str, Any]:
        return self._chunk([], usage=usage(prompt_tokens, completion_tokens, cached_tokens))

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(kind, choices, **extra)

    def _envelope(
        self, object_: str, choices: list[dict[str, Any]], **extra: Any
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_positive_int(payload: dict[str, Any], key: str) -> int | None:
    value = payload.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise request_error(f"`{key}` must be a positive integer", param=key)
    return int(value)
