"""A stored response is found again on the engine that made it, by the id Sluice hands out.
Pure.

A Responses API response lives on one engine (vLLM keeps what `store` asks in its own
process), so a follow-up naming it (`previous_response_id`) and `GET` / `DELETE
/v1/responses/{id}` and `POST .../cancel` must reach that engine. Sluice tags every response
id it relays with its backend's id: `resp_abc` from backend `b-1a2b3c4d` reaches the client
as `resp_abc-sl1a2b3c4d`, and the tag is taken off again, and followed, when the id comes
back. Nothing is kept: no table to bound, and a tagged id is found after a restart and
through any replica, for a backend's id is a hash of its URL, the same everywhere. An id whose
backend has left the pool, or one without a tag, is 404 in OpenAI's shape; a
`previous_response_id` without a tag (made elsewhere) is routed as any other request, and its
engine answers for it.

The relayed answer is rewritten in passing: the engine's id, learnt from the answer's first
`"id":"resp_..."` (the response object's own, in the JSON body and in the stream's first
event), and the previous response's it was asked with, are replaced wherever they appear,
a `bytes.replace` or two per read of the backend.
"""

from __future__ import annotations

import re

TAG = "-sl"
_TAGGED = re.compile(r"(.+)-sl([0-9a-f]{8})")
_FIRST_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]{1,200})"')
# Bytes held back while the engine's id is not seen yet: it comes within the first few
# hundred bytes of an answer, or never.
MAX_HELD = 4096


def tag(response_id: str, backend_id: str) -> str:
    return f"{response_id}{TAG}{backend_id.removeprefix('b-')}"


def untag(tagged: str) -> tuple[str, str] | None:
    """(the engine's id, its backend's id) of an id Sluice handed out; None for another."""
    match = _TAGGED.fullmatch(tagged)
    if match is None:
        return None
    return match.group(1), "b-" + match.group(2)


class IdTagger:
    """The relay's converter for a Responses answer: the engine's response ids, tagged.

    `known` are engine ids the answer will name (the `previous_response_id` it was asked
    with); its own id is learnt from its first bytes."""

    __slots__ = ("_backend_id", "_held", "_learnt", "_pairs", "_passing")

    def __init__(self, backend_id: str, known: tuple[str, ...] = ()) -> None:
        self._backend_id = backend_id
        self._pairs = [self._pair(engine_id.encode()) for engine_id in known]
        self._held = b""
        self._learnt = False
        self._passing = False  # no response id in its first bytes: not a response object

    def _pair(self, engine_id: bytes) -> tuple[bytes, bytes]:
        tagged = tag(engine_id.decode(), self._backend_id).encode()
        return b'"' + engine_id + b'"', b'"' + tagged + b'"'

    def _tagged(self, data: bytes) -> bytes:
        for old, new in self._pairs:
            data = data.replace(old, new)
        return data

    def feed(self, data: bytes) -> bytes:
        if self._learnt or self._passing:
            return self._tagged(data)
        held = self._held + data
        found = _FIRST_ID.search(held)
        if found is None:
            if len(held) < MAX_HELD:
                self._held = held
                return b""
            self._held, self._passing = b"", True
            return self._tagged(held)
        self._held = b""
        self._learnt = True
        self._pairs.insert(0, self._pair(found.group(1)))
        return self._tagged(held)

    def finish(self) -> bytes:
        held, self._held = self._held, b""
        return self._tagged(held)
