"""`--forward tokens`, the pure parts alone: how a backend's completion is reshaped into the
chat answer the client asked for (whole and streamed, events split anywhere), what is sent
for each kind of request, and how a /tokenize answer is judged. No Trio, no HTTP."""

from __future__ import annotations

import json
from array import array
from typing import Any

import pytest

from app.fleet.backends import TokenizerProbe
from app.fleet.tokenizer_check import build_probe, compare_tokens, judge_answer
from app.preprocess.pipeline import Prepared
from app.proxy.chat_conversion import ChatStreamConverter, completion_to_chat
from app.proxy.forward_tokens import plan_forward

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi there."}]}

# ---------------------------------------------------------------- reshaping answers


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def text_chunk(index: int, text: str, finish: str | None = None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": "cmpl-7", "object": "text_completion", "model": "m", "choices": [choice]}


USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_a_whole_completion_becomes_a_chat_completion() -> None:
    completion = {
        "id": "cmpl-42",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"},
            {"index": 1, "text": "Bye", "logprobs": None, "finish_reason": "stop"},
        ],
        "usage": USAGE,
    }
    chat = json.loads(completion_to_chat(json.dumps(completion).encode()))
    assert chat == {
        "id": "chatcmpl-42",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "length",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "Bye"},
                "logprobs": None,
                "finish_reason": "stop",
            },
        ],
        "usage": USAGE,
    }
    with pytest.raises(ValueError):
        completion_to_chat(b'{"error": {"message": "no"}}')
    with pytest.raises(ValueError):
        completion_to_chat(b"not json")


def test_stream_events_are_converted_as_they_complete_even_when_split() -> None:
    error = {"error": {"message": "boom", "type": "upstream_error", "code": None}}
    usage_chunk = {"id": "cmpl-7", "object": "text_completion", "choices": [], "usage": USAGE}
    stream = b"".join(
        [
            sse(text_chunk(0, "Hel")),
            sse(text_chunk(1, "Bye")),
            b": keep-alive comment\n\n",
            sse(text_chunk(0, "lo", "length")),
            sse(usage_chunk),
            sse(error),
            b"data: [DONE]\n\n",
        ]
    )
    whole = ChatStreamConverter().feed(stream)
    # The same stream one byte at a time converts to the same bytes.
    converter = ChatStreamConverter()
    assert b"".join(converter.feed(stream[i : i + 1]) for i in range(len(stream))) == whole
    assert converter.finish() == b""

    events = whole.split(b"\n\n")[:-1]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events if e.startswith(b"data: {")]
    assert [c["object"] for c in chunks[:4]] == ["chat.completion.chunk"] * 4
    assert {c["id"] for c in chunks[:4]} == {"chatcmpl-7"}
    assert chunks[0]["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "Hel"},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert chunks[1]["choices"][0]["delta"] == {"role": "assistant", "content": "Bye"}
    assert chunks[2]["choices"][0]["delta"] == {"content": "lo"}  # role only once a choice
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"] == USAGE
    assert chunks[4] == error  # error events pass unchanged
    assert events[2] == b": keep-alive comment"
    assert events[-1] == b"data: [DONE]"


def test_stream_conversion_holds_back_only_the_unfinished_event() -> None:
    converter = ChatStreamConverter()
    first, second = sse(text_chunk(0, "a")), sse(text_chunk(0, "b"))
    out = converter.feed(first + second[:10])
    assert out.endswith(b"\n\n") and b'"content":"a"' in out
    assert converter.feed(second[10:-1]) == b""  # its blank line has not arrived yet
    assert b'"content":"b"' in converter.feed(second[-1:])
    assert converter.feed(b"data: [DO") == b""
    assert converter.finish() == b"data: [DO"  # a cut-off last event is passed on as it is


# ---------------------------------------------------------------- what is sent


def prepared(
    payload: dict[str, Any], ids: list[int] | None, prompt: str | None = "text"
) -> Prepared:
    """What the preprocessor makes of `payload`: its fields but the prompt's, and `ids`."""
    fields = {k: v for k, v in payload.items() if k not in ("messages", "prompt")}
    token_ids = None if ids is None else array("I", ids)
    return Prepared(fields.get("model"), fields, prompt, "thread", 0.0, token_ids)


# Sampling parameters a token completion takes as the chat gave them.
SAMPLING = {
    "temperature": 0.5,
    "n": 2,
    "stop": ["\n"],
    "stream": True,
    "stream_options": {"include_usage": True},
    "top_k": 3,
}


def test_chat_becomes_a_token_completion_with_its_sampling_parameters() -> None:
    payload = {
        **CHAT,
        "max_completion_tokens": 7,
        "max_tokens": 99,
        **SAMPLING,
        "logprobs": False,
        "tools": [],
        "add_generation_prompt": True,
    }
    plan = plan_forward("chat", "/v1/chat/completions", b"{}", prepared(payload, [5, 6, 7]))
    assert (plan.path, plan.label, plan.answer_as_chat) == ("/v1/completions", "tokens", True)
    assert json.loads(plan.body) == {"model": "m", "max_tokens": 7, **SAMPLING, "prompt": [5, 6, 7]}


def test_what_a_token_completion_cannot_express_is_passed_through() -> None:
    body = b'{"original": true}'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    cases: list[tuple[str, dict[str, Any], list[int] | None, str]] = [
        ("chat", {**CHAT, "tools": tools, "tool_choice": "auto"}, [1], "tools, tool_choice"),
        ("chat", {**CHAT, "response_format": {"type": "json_object"}}, [1], "response_format"),
        ("chat", {**CHAT, "logprobs": True, "top_logprobs": 2}, [1], "logprobs, top_logprobs"),
        ("chat", CHAT, None, "no token ids: tokenization was skipped"),
        ("completion", {"prompt": [1, 2]}, [1, 2], "the prompt is token ids already"),
    ]
    for kind, payload, ids, why in cases:
        given = prepared(payload, ids, None if kind == "completion" else "text")
        plan = plan_forward(kind, "/v1/x", body, given)
        assert (plan.path, plan.body, plan.answer_as_chat) == ("/v1/x", body, False)
        assert plan.label == f"passthrough ({why})"


def test_a_text_completion_keeps_its_fields_and_gets_ids() -> None:
    payload = {"model": "m", "prompt": "Hello", "echo": True, "max_tokens": 3}
    plan = plan_forward("completion", "/v1/completions", b"", prepared(payload, [0, 9]))
    assert (plan.label, plan.answer_as_chat) == ("tokens", False)
    assert json.loads(plan.body) == {**payload, "prompt": [0, 9]}


# ---------------------------------------------------------------- judging /tokenize

PROBE = TokenizerProbe("probe", (10, 20, 30))


def test_tokenize_answers_are_judged_id_by_id() -> None:
    assert compare_tokens([10, 20, 30], PROBE.expected).state == "verified"
    assert compare_tokens([10, 21, 30], PROBE.expected).detail == (
        "mismatch at token 1: backend 21 vs sluice 20"
    )
    assert compare_tokens([10, 20], PROBE.expected).detail == (
        "mismatch at token 2: backend gave 2 tokens, sluice 3"
    )
    assert judge_answer(404, None, PROBE).state == "refused"
    assert "no /tokenize endpoint" in judge_answer(404, None, PROBE).detail
    assert judge_answer(422, {}, PROBE).state == "refused"
    assert judge_answer(503, None, PROBE).state == "unchecked"  # retried later
    assert judge_answer(200, {"tokens": ["a"]}, PROBE).state == "refused"


def test_the_probe_includes_a_special_token_when_there_is_one() -> None:
    def encode(text: str) -> list[int]:
        return [len(text)]

    assert "<s>" in build_probe(encode, ["<s>", "</s>"]).text
    plain = build_probe(encode, [])
    assert plain.expected == (len(plain.text),)
    for needed in ("\n\n\n", "\t", "  ", "Привет", "你好", "3.14159"):
        assert needed in plain.text
