"""What a backend's answer says it used: `usage` read off the end of the response. Pure.

Every API's shape: chat, completions and embeddings (`prompt_tokens`, `completion_tokens`),
the Responses API and Anthropic's Messages (`input_tokens`, `output_tokens`).

vLLM (with `--enable-prompt-tokens-details`) and the simulated backend report
`usage.prompt_tokens_details.cached_tokens`: the prompt tokens its prefix cache served. It
sits at the end of an answer: the last object of a JSON body, or the last event before
`[DONE]` of a stream that asked for `stream_options.include_usage`. So the proxy keeps only
the last `TAIL_BYTES` it relayed (app/proxy/relay.py) and reads the numbers from there,
instead of parsing whole answers on its hot path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TAIL_BYTES = 2048

_USAGE = b'"usage"'
_FIELD = re.compile(
    rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens|cached_tokens)"\s*:\s*(\d+)'
)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


def usage_from_tail(tail: bytes) -> Usage | None:
    """The last `usage` object in `tail`, or None when there is none."""
    start = tail.rfind(_USAGE)
    if start < 0:
        return None
    # Stop at the next event or before anything after the usage object's closing braces.
    end = tail.find(b"\n\n", start)
    fields = {
        name.decode(): int(value)
        for name, value in _FIELD.findall(tail, start, end if end >= 0 else len(tail))
    }
    if not fields:
        return None
    # OpenAI's chat and completions say prompt/completion tokens; its Responses API and
    # Anthropic's Messages say input/output tokens (Messages' last usage, in `message_delta`,
    # may hold only the output's).
    return Usage(
        fields.get("prompt_tokens", fields.get("input_tokens")),
        fields.get("completion_tokens", fields.get("output_tokens")),
        fields.get("cached_tokens"),
    )
