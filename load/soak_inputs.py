"""The bad input a soak throws at the proxy: every kind of malformed body a real client (or
attacker) sends. Each must be answered with a shaped 4xx; a 5xx or a reset is a bug.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class BadInput:
    name: str
    path: str
    body: bytes
    content_type: str = "application/json"


def _chat(**fields: object) -> bytes:
    return json.dumps({"model": "sim", **fields}).encode()


def catalog(
    long_prompt_bytes: int = 12 * 1024 * 1024, over_limit_bytes: int = 17 * 1024 * 1024
) -> list[BadInput]:
    """One of each; the large ones are built once, here."""
    chat = "/v1/chat/completions"
    hello = [{"role": "user", "content": "hi"}]
    deep_list = b'{"model": "sim", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    deep_dict = (
        b'{"model": "sim", "messages": [{"role": "user", "content": '
        + b'{"a":' * 50_000
        + b"1"
        + b"}" * 50_000
        + b"}]}"
    )
    words = (b"lorem ipsum dolor sit amet " * (long_prompt_bytes // 27 + 1))[:long_prompt_bytes]
    over_long = b'{"model": "sim", "max_tokens": 1, "prompt": "' + words + b'"}'
    return [
        BadInput("invalid_json", chat, b'{"model": "sim", "messages": [}'),
        BadInput("truncated_json", chat, _chat(messages=hello)[:-7]),
        BadInput("empty_body", chat, b""),
        BadInput("json_null", chat, b"null"),
        BadInput("json_array", chat, b'[{"role": "user", "content": "hi"}]'),
        BadInput(
            "not_utf8",
            chat,
            b'{"model": "sim", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        ),
        BadInput(
            "lone_surrogate",
            chat,
            b'{"model": "sim", "messages": [{"role": "user", "content": "\\ud800"}]}',
        ),
        BadInput(
            "nan_literal",
            chat,
            b'{"model": "sim", "max_tokens": NaN, "messages": [{"role": "user", "content": "hi"}]}',
        ),
        BadInput("messages_string", chat, _chat(messages="hello")),
        BadInput("messages_empty", chat, _chat(messages=[])),
        BadInput("role_missing", chat, _chat(messages=[{"content": "hi"}])),
        BadInput("role_unknown", chat, _chat(messages=[{"role": "wizard", "content": "hi"}])),
        BadInput("content_number", chat, _chat(messages=[{"role": "user", "content": 42}])),
        BadInput(
            "content_parts_bad",
            chat,
            _chat(messages=[{"role": "user", "content": [{"type": "image"}]}]),
        ),
        BadInput("max_tokens_negative", chat, _chat(messages=hello, max_tokens=-1)),
        BadInput("max_tokens_huge", chat, _chat(messages=hello, max_tokens=10**30)),
        BadInput("stream_string", chat, _chat(messages=hello, stream="yes")),
        BadInput("prompt_list_of_lists", "/v1/completions", _chat(prompt=[[1, 2], ["x"]])),
        BadInput("prompt_missing", "/v1/completions", _chat(max_tokens=1)),
        BadInput(
            "form_encoded", chat, b"model=sim&messages=hi", "application/x-www-form-urlencoded"
        ),
        BadInput("deep_list_100k", chat, deep_list),
        BadInput("deep_dict_50k", chat, deep_dict),
        BadInput("over_long_12MB", "/v1/completions", over_long),
        BadInput("over_body_limit_17MB", chat, b"[" + b" " * over_limit_bytes + b"]"),
        BadInput("megabyte_garbage", chat, bytes(range(256)) * 4096),
    ]
