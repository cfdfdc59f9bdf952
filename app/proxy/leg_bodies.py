"""The bodies of a disaggregated request's two legs, and what a prefill's answer says. Pure.

vLLM's flow: the prefill leg is the client's body made a one-token, unstreamed prefill that
asks the engine to keep its KV cache for a remote decode (`prefill_body`); the decode leg is
the client's body with the `kv_transfer_params` the prefill answered, copied unchanged
(`transfer_params_of`, then `with_members`). SGLang's flow: both legs are the client's body
with the prefill engine's bootstrap address and a room (`bootstrap_members`).

`with_members` puts members at the front of the client's JSON object without parsing it:
the decode leg leaves the moment the prefill answers, and a splice costs a copy, where
parsing and writing again a long conversation would cost the loop in proportion to it. It
is only used when the client's fields hold none of those names (the caller checks the
request's parsed fields), so no name is given twice.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

# The prefill leg's ask (vLLM's NIXL connector's, as its example proxy sends it).
PREFILL_TRANSFER_ASK = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What a prefill leg must not carry: it answers once, unstreamed, and stops at one token.
NOT_IN_PREFILL = ("stream_options", "min_tokens")
# Each API's name for the output budget (the Responses API's, and the others').
BUDGET_NAMES = {"responses": ("max_output_tokens",)}
DEFAULT_BUDGET_NAMES = ("max_tokens", "max_completion_tokens")
# Names whose presence in the client's own fields means the body is rewritten whole.
LEG_MEMBERS = frozenset(
    {"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"}
)
# A prefill's whole answer is one token and its usage: anything much larger is not one.
MAX_PREFILL_ANSWER = 1 << 20


def prefill_body(body: bytes, kind: str) -> bytes:
    """The prefill leg of vLLM's flow for a request of endpoint kind `kind`."""
    payload: dict[str, Any] = json.loads(body)
    for name in NOT_IN_PREFILL:
        payload.pop(name, None)
    payload["stream"] = False
    for name in BUDGET_NAMES.get(kind, DEFAULT_BUDGET_NAMES):
        payload[name] = 1
    payload["kv_transfer_params"] = PREFILL_TRANSFER_ASK
    return _dumps(payload)


def transfer_params_of(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill engine's answer; None when it has none (an
    engine without a KV connector answers the request as any other)."""
    try:
        payload = json.loads(answer)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
    return params if isinstance(params, dict) and params else None


def bootstrap_members(host: str, port: int) -> dict[str, Any]:
    """SGLang's bootstrap fields: the prefill engine's address and a fresh 63-bit room."""
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": _room()}


def with_members(body: bytes, members: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """The client's body with `members` added; `fields`: the client's own parsed fields
    (those but the prompt), to tell whether a splice names nothing twice."""
    if LEG_MEMBERS.isdisjoint(fields) and body[:1] == b"{":
        added = _dumps(dict(members))[1:-1]
        rest = body[1:].lstrip()
        return b"{" + added + (b"" if rest[:1] == b"}" else b",") + rest
    payload: dict[str, Any] = json.loads(body)
    payload.update(members)
    return _dumps(payload)


def _room() -> int:
    return random.getrandbits(63)


def _dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()
