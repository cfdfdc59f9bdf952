"""A backend's text completion, returned as the chat completion the client asked for.

With `--forward tokens` a chat request reaches the backend as `/v1/completions` with the
rendered prompt's token ids, so its answer is completion-shaped; the client must still get
a chat completion. Pure (bytes in, bytes out, no I/O), like h11: the relay feeds it.

Whole answers: `object` becomes "chat.completion", each choice's `text` becomes
`message = {"role": "assistant", "content": text}`, the id gets the "chatcmpl-" prefix;
`usage` and everything else stay. Streams: each `text_completion` event becomes a
`chat.completion.chunk` whose choice carries `delta` (the first of each choice also its
role); usage chunks are relabelled, `[DONE]`, error events, comments and anything else pass
through unchanged. Events are converted one by one as they complete: only the part after
the last blank line is held back.
"""

from __future__ import annotations

import json
from typing import Any

CHAT_ID_PREFIX = "chatcmpl-"
# Where an SSE event ends. vLLM, SGLang and llama.cpp use "\n\n"; CRLF is legal SSE too.
EVENT_ENDS = (b"\n\n", b"\r\n\r\n")


def chat_id(completion_id: Any) -> str:
    """`cmpl-abc` -> `chatcmpl-abc`; the same input always gives the same id."""
    text = str(completion_id)
    return CHAT_ID_PREFIX + (text.removeprefix("cmpl-"))


def completion_to_chat(body: bytes) -> bytes:
    """A whole completions response body as a chat completion body.

    Raises ValueError when the body is not a completions response.
    """
    completion = json.loads(body)  # JSONDecodeError is a ValueError
    choices = completion.get("choices") if isinstance(completion, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ValueError("no list of choices in the backend's completion")
    chat_choices = []
    for choice in choices:
        message = {"role": "assistant", "content": choice.get("text") or ""}
        rest = {k: v for k, v in choice.items() if k not in ("index", "text")}
        chat_choices.append({"index": choice.get("index", 0), "message": message, **rest})
    chat = {
        **completion,
        "id": chat_id(completion.get("id")),
        "object": "chat.completion",
        "choices": chat_choices,
    }
    return _dumps(chat)


class ChatStreamConverter:
    """Turns a completions event stream into a chat one, chunk by chunk as they arrive."""

    def __init__(self) -> None:
        self._pending = b""  # the start of an event whose end has not arrived yet
        self._roles_sent: set[int] = set()  # choice indexes whose first delta went out

    def feed(self, data: bytes) -> bytes:
        """The converted form of every event that `data` completes (possibly b"")."""
        buffer = self._pending + data
        out = []
        start = 0
        while True:
            end, separator = _next_event_end(buffer, start)
            if end < 0:
                break
            out.append(self._convert_event(buffer[start:end]) + separator)
            start = end + len(separator)
        self._pending = buffer[start:]
        return b"".join(out)

    def finish(self) -> bytes:
        """At the end of the body: an unterminated last event, passed on as it is."""
        rest, self._pending = self._pending, b""
        return rest

    def _convert_event(self, event: bytes) -> bytes:
        lines = event.splitlines()
        data_lines = [line for line in lines if line.startswith(b"data:")]
        if not data_lines:
            return event
        data = b"\n".join(_field_value(line) for line in data_lines)
        try:
            payload = json.loads(data)
        except ValueError:
            return event  # [DONE] and anything else that is not JSON
        if not isinstance(payload, dict) or payload.get("object") != "text_completion":
            return event  # error events and the unknown
        converted = b"data: " + _dumps(self._chat_chunk(payload))
        others = [line for line in lines if not line.startswith(b"data:")]
        return b"\n".join([*others, converted])

    def _chat_chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            delta: dict[str, Any] = {}
            if index not in self._roles_sent:
                self._roles_sent.add(index)
                delta["role"] = "assistant"
            if choice.get("text") is not None:
                delta["content"] = choice["text"]
            rest = {k: v for k, v in choice.items() if k not in ("index", "text")}
            choices.append({"index": index, "delta": delta, **rest})
        return {
            **chunk,
            "id": chat_id(chunk.get("id")),
            "object": "chat.completion.chunk",
            "choices": choices,
        }


def _next_event_end(buffer: bytes, start: int) -> tuple[int, bytes]:
    """Where the first event after `start` ends, and its separator; (-1, b"") if not yet."""
    found = [(buffer.find(sep, start), sep) for sep in EVENT_ENDS]
    found = [(at, sep) for at, sep in found if at >= 0]
    return min(found) if found else (-1, b"")


def _field_value(line: bytes) -> bytes:
    """`data: x` -> `x`: the SSE field value loses one leading space."""
    value = line[len(b"data:") :]
    return value[1:] if value.startswith(b" ") else value


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()
