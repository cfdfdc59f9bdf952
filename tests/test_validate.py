"""Request validation alone: bodies parse as `json.loads` parses them, and every malformed
body names the offending param (its `model` is resolved before, tests/test_models.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.errors import ClientError
from app.preprocess.json_bodies import parse_json_object
from app.preprocess.request_bodies import check_chat, check_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body", [b"", b"{", b"[1, 2]", b"\xff\xfe", b"null"])
def test_bodies_that_are_not_json_objects(body: bytes) -> None:
    with pytest.raises(ClientError):
        parse_json_object(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": "\xc3\xa9"}',
        b'{"a": "\xed\xa0\x80"}',  # an encoded lone surrogate, as json.loads takes it
        '{"a": 1}'.encode("utf-16-le"),
        '{"a": 1}'.encode("utf-32"),
        b'\xef\xbb\xbf{"a": 1}',
        b' {"a": 1} ',
        b'{"a": 1} x',
        b'{"a": "\xff"}',
    ],
)
def test_bodies_parse_as_json_loads_parses_them(body: bytes) -> None:
    try:
        expected = json.loads(body)
    except ValueError:
        with pytest.raises(ClientError):
            parse_json_object(body)
    else:
        assert parse_json_object(body) == expected


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": None}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
        ),
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": [1]}, "stop"),
        ({"n": 1.5}, "n"),
    ],
)
def test_chat_errors_name_the_param(change: dict[str, Any], param: str) -> None:
    body = {**CHAT, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ClientError) as info:
        check_chat(body)
    assert info.value.param == param
    assert info.value.message


def test_valid_chat_passes_including_parts_and_tool_turns() -> None:
    check_chat(CHAT)
    check_chat(
        {
            "model": "m",
            "stream": True,
            "max_tokens": 5,
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}]},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "42", "tool_call_id": "x"},
            ],
        }
    )


@pytest.mark.parametrize("prompt", ["hi", ["hi"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_shapes(prompt: Any) -> None:
    check_completion({"model": "m", "prompt": prompt})


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], [-1], [[]], {"a": 1}])
def test_completion_bad_prompts(prompt: Any) -> None:
    body: dict[str, Any] = {"model": "m"}
    if prompt is not None:
        body["prompt"] = prompt
    with pytest.raises(ClientError) as info:
        check_completion(body)
    assert info.value.param == "prompt"
