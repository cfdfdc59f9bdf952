"""Disaggregated serving's pure parts: the legs' bodies (app/proxy/leg_bodies.py), the
prefill's cached tokens written over the decode's answer (app/proxy/prefill_usage.py),
fed whole and then byte by byte, and the roles of the configuration (app/config.py)."""

from __future__ import annotations

import json

import pytest

from app.config import BackendRole, Settings, parse_role_flag
from app.proxy.leg_bodies import (
    PREFILL_TRANSFER_ASK,
    bootstrap_members,
    prefill_body,
    transfer_params_of,
    with_members,
)
from app.proxy.prefill_usage import Chained, PrefillCachedTokens, PrefillFigure

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 50,
    "max_completion_tokens": 40,
    "min_tokens": 5,
    "temperature": 0.2,
}


def test_the_prefill_leg_is_one_unstreamed_token_that_asks_for_a_remote_decode() -> None:
    leg = json.loads(prefill_body(json.dumps(CHAT).encode(), "chat"))
    assert leg["kv_transfer_params"] == PREFILL_TRANSFER_ASK
    assert leg["stream"] is False
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["messages"] == CHAT["messages"] and leg["temperature"] == 0.2


def test_the_responses_apis_prefill_leg_caps_max_output_tokens() -> None:
    body = {"model": "m", "input": "hi", "max_output_tokens": 300, "stream": True}
    leg = json.loads(prefill_body(json.dumps(body).encode(), "responses"))
    assert leg["max_output_tokens"] == 1 and "max_tokens" not in leg
    assert leg["stream"] is False


@pytest.mark.parametrize("body", [b'{"a":1}', b'{ "a" : [1, 2] }', b"{}", b'{\n"a": {}}'])
def test_members_are_spliced_in_front_of_any_object(body: bytes) -> None:
    params = {"remote_engine_id": "e-1", "remote_block_ids": [1, 2]}
    spliced = with_members(body, {"kv_transfer_params": params}, json.loads(body))
    assert json.loads(spliced) == {"kv_transfer_params": params, **json.loads(body)}


def test_a_body_that_names_a_member_already_is_written_again_without_a_name_twice() -> None:
    body = b'{"kv_transfer_params": {"old": 1}, "a": 1}'
    spliced = with_members(body, {"kv_transfer_params": {"new": 2}}, json.loads(body))
    assert spliced.count(b"kv_transfer_params") == 1
    assert json.loads(spliced) == {"kv_transfer_params": {"new": 2}, "a": 1}


def test_the_transfer_parameters_are_taken_as_they_came() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_port": 5600}
    answer = json.dumps({"id": "x", "choices": [], "kv_transfer_params": params}).encode()
    assert transfer_params_of(answer) == params
    assert transfer_params_of(b'{"id": "x"}') is None
    assert transfer_params_of(b'{"kv_transfer_params": null}') is None
    assert transfer_params_of(b"not json") is None


def test_a_bootstrap_room_is_a_fresh_63_bit_number_each_time() -> None:
    rooms = {bootstrap_members("10.0.0.1", 8998)["bootstrap_room"] for _ in range(50)}
    assert len(rooms) == 50 and all(0 <= room < 2**63 for room in rooms)


STREAM_END = (
    b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":900,"completion_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens": 900}}}\n\n'
    b"data: [DONE]\n\n"
)


def _fed(converter: PrefillCachedTokens | Chained, pieces: list[bytes]) -> bytes:
    return b"".join(converter.feed(piece) for piece in pieces) + converter.finish()


@pytest.mark.parametrize("whole", [True, False])
def test_the_decodes_cached_tokens_become_the_prefills(whole: bool) -> None:
    pieces = [STREAM_END] if whole else [STREAM_END[i : i + 1] for i in range(len(STREAM_END))]
    out = _fed(PrefillCachedTokens(PrefillFigure(256)), pieces)
    assert out == STREAM_END.replace(b'"cached_tokens": 900', b'"cached_tokens": 256')


def test_an_unknown_prefill_figure_leaves_the_answer_as_it_came() -> None:
    assert _fed(PrefillCachedTokens(PrefillFigure()), [STREAM_END]) == STREAM_END


def test_a_figure_known_after_the_stream_began_still_counts() -> None:
    figure = PrefillFigure()
    converter = PrefillCachedTokens(figure)
    first = converter.feed(STREAM_END[:40])
    figure.cached_tokens = 16
    out = first + converter.feed(STREAM_END[40:]) + converter.finish()
    assert b'"cached_tokens": 16' in out and b'"cached_tokens": 900' not in out


def test_chained_converters_each_see_what_the_one_before_let_through() -> None:
    chained = Chained(
        (PrefillCachedTokens(PrefillFigure(1)), PrefillCachedTokens(PrefillFigure(2)))
    )
    pieces = [STREAM_END[i : i + 7] for i in range(0, len(STREAM_END), 7)]
    assert b'"cached_tokens": 2' in _fed(chained, pieces)


def test_role_flags_and_their_checks() -> None:
    assert parse_role_flag("prefill", "http://p:8000/=9000") == BackendRole(
        "http://p:8000", "prefill", 9000
    )
    assert parse_role_flag("decode", "http://d:8000") == BackendRole("http://d:8000", "decode")
    with pytest.raises(ValueError, match="expected URL"):
        parse_role_flag("decode", "http://d:8000=9000")
    with pytest.raises(ValueError, match="two roles"):
        Settings(prefill=("http://x:1",), decode=("http://x:1",))
    with pytest.raises(ValueError, match="two roles"):
        Settings(backends=("http://x:1",), decode=("http://x:1",))
    settings = Settings(prefill=("http://p:1=7000",), decode=("http://d:1",))
    assert settings.all_backends == ("http://p:1", "http://d:1")
