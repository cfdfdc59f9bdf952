"""The responses a simulated backend keeps (`store: true`), bounded, least recently used first.

vLLM keeps them in a plain dict that only grows, and only with
`VLLM_ENABLE_RESPONSES_API_STORE=1` (otherwise it quietly ignores `store`); the sim always
honours `store` (true unless the request says otherwise, as in OpenAI's API) and keeps the
last `capacity` responses, so a long benchmark cannot exhaust its memory. Each is kept as
its JSON bytes and its conversation as tuples of strings, which the garbage collector stops
tracking: ten thousand stored responses add little to a full collection of a process that
also runs the proxy (`sluice demo`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import trio

from app.errors import require_at_least
from app.sim.responses_format import Turn

CAPACITY = 10_000


class StoredResponse:
    __slots__ = ("body", "running", "turns")

    def __init__(
        self,
        response: dict[str, Any],
        turns: tuple[Turn, ...],
        running: trio.CancelScope | None = None,
    ) -> None:
        # The response object as GET /v1/responses/{id} answers it.
        self.body = _encode(response)
        # The conversation that led to it (what a follow-up's `previous_response_id` continues).
        self.turns = turns
        # A background response still running: cancelling this stops it.
        self.running = running

    @property
    def response(self) -> dict[str, Any]:
        decoded: dict[str, Any] = json.loads(self.body)
        return decoded

    @property
    def status(self) -> str:
        return str(self.response["status"])

    def set_status(self, status: str) -> dict[str, Any]:
        response = self.response
        response["status"] = status
        self.body = _encode(response)
        return response


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY) -> None:
        require_at_least(1, capacity=capacity)
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.capacity:
            _, evicted = self._responses.popitem(last=False)
            if evicted.running is not None:
                evicted.running.cancel()

    def pop(self, response_id: str) -> StoredResponse | None:
        return self._responses.pop(response_id, None)


def _encode(response: dict[str, Any]) -> bytes:
    return json.dumps(response, separators=(",", ":")).encode()
