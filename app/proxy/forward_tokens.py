"""`--forward tokens`: what to send the backend for one request. Pure: no I/O.

Chat and text completions leave as `/v1/completions` whose prompt is the token ids Sluice
computed, so the backend skips templating and tokenization (the inference server's own
preprocessing, app/README.md). The backend is one whose /tokenize was shown
to match Sluice's (app/fleet/tokenizer_check.py); nothing here guesses.

Left as the client sent them ("passthrough (why)" in `x-sluice-forward`): requests without
ids (tokenization bailed out under saturation), completions whose prompt already is ids, and
chat requests using what a token completion cannot express (tools, response_format, chat
logprobs, any field not known to be safe to carry or drop).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.preprocess.pipeline import Prepared

COMPLETIONS_PATH = "/v1/completions"

# Chat fields a completions request understands the same way: OpenAI's sampling parameters
# and vLLM's extra ones.
CARRIED_TO_COMPLETION = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "user",
        "stream",
        "stream_options",
        # vLLM's sampling extras
        "top_k",
        "min_p",
        "repetition_penalty",
        "length_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "bad_words",
        "allowed_token_ids",
        "priority",
    }
)
# Chat fields already spent on rendering the prompt Sluice tokenized.
RENDERED_INTO_PROMPT = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "documents",
    }
)
# Chat's name for the output budget, and what completions calls it.
RENAMED = {"max_completion_tokens": "max_tokens"}


@dataclass(frozen=True)
class ForwardPlan:
    path: str
    body: bytes
    label: str  # the `x-sluice-forward` header: "tokens" or "passthrough (why)"
    answer_as_chat: bool  # the backend answers a completion; the client asked for chat


def plan_forward(kind: str, path: str, body: bytes, prepared: Prepared) -> ForwardPlan:
    """What to send for one request; `prepared.fields` are its fields but the prompt's."""
    ids = prepared.token_ids
    payload = prepared.fields
    if ids is None:
        return _passthrough(path, body, "no token ids: tokenization was skipped")
    if kind == "completion" and prepared.prompt is None:
        return _passthrough(path, body, "the prompt is token ids already")
    try:
        return _token_plan(kind, path, body, payload, ids)
    except RecursionError:
        return _passthrough(path, body, "fields nested too deeply to encode again")


def _token_plan(
    kind: str, path: str, body: bytes, payload: dict[str, Any], ids: Sequence[int]
) -> ForwardPlan:
    if kind == "completion":
        return ForwardPlan(path, _dumps({**payload, "prompt": list(ids)}), "tokens", False)
    unexpressible = [
        key
        for key, value in payload.items()
        if _is_used(value)
        and key not in CARRIED_TO_COMPLETION
        and key not in RENDERED_INTO_PROMPT
        and key not in RENAMED
    ]
    if unexpressible:
        return _passthrough(path, body, ", ".join(unexpressible))
    completion = {key: value for key, value in payload.items() if key in CARRIED_TO_COMPLETION}
    for chat_name, completion_name in RENAMED.items():
        if payload.get(chat_name) is not None:  # chat's own name wins, as OpenAI documents
            completion[completion_name] = payload[chat_name]
    completion["prompt"] = list(ids)
    return ForwardPlan(COMPLETIONS_PATH, _dumps(completion), "tokens", True)


def _passthrough(path: str, body: bytes, why: str) -> ForwardPlan:
    return ForwardPlan(path, body, f"passthrough ({why})", False)


def _is_used(value: Any) -> bool:
    """`"logprobs": false`, `"tools": []` or a null ask for nothing."""
    return value is not None and value is not False and value != [] and value != {}


def _dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()
