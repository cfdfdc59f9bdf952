"""Every endpoint the engines serve that Sluice routes by model, and what each one's stream
looks like at its end. Pure.

A request to any of them is read as its kind says (app/preprocess/request_bodies.py): chats
and completions rendered and tokenized as ever; Responses and Messages conversations rendered
with the model's chat template to route them by their prefix; the rest (embeddings, rerank,
score, classify, pooling, tokenize, detokenize, audio uploads) routed by their model alone,
by load. All go through the same pools, admission, keys, budgets, retries and metrics.

A stream is finished once its engine says so: `data: [DONE]` for chat and completions,
`response.completed` (or `.failed`, `.incomplete`) for Responses, `message_stop` for
Messages. A stream cut after that (llama-cpp-python's server sometimes drops its last chunk
after `[DONE]`) ends cleanly for the client; one cut before gets the error event of its own
API, so its SDK reports an error rather than a truncated answer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

from app.errors import error_body
from app.preprocess.request_bodies import Kind

BROKEN_CODE = "backend_stream_broken"


def openai_broken(message: str) -> bytes:
    payload = error_body(message, "upstream_error", None, BROKEN_CODE)
    return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"


def responses_broken(message: str) -> bytes:
    payload = {"type": "error", "code": BROKEN_CODE, "message": message, "param": None}
    return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"


def messages_broken(message: str) -> bytes:
    payload = {"type": "error", "error": {"type": "api_error", "message": message}}
    return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"


@dataclass(frozen=True)
class Endpoint:
    name: str  # its label in metrics and the request log
    kind: Kind  # how its body is read
    # What the end of a stream the engine finished holds (any one of them).
    finished: tuple[bytes, ...] = (b"data: [DONE]",)
    broken: Callable[[str], bytes] = openai_broken
    tags_response_ids: bool = False  # its answers name stored responses (response_ids.py)

    def finished_in(self, tail: bytes) -> bool:
        return any(marker in tail for marker in self.finished)


CHAT = Endpoint("chat", "chat")
COMPLETION = Endpoint("completion", "completion")
RESPONSES = Endpoint(
    "responses",
    "responses",
    (b'"response.completed"', b'"response.failed"', b'"response.incomplete"'),
    responses_broken,
    tags_response_ids=True,
)
MESSAGES = Endpoint("messages", "messages", (b'"message_stop"',), messages_broken)


def _by_model(name: str, kind: Kind = "model") -> Endpoint:
    return Endpoint(name, kind, (), openai_broken)


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/v1/embeddings": _by_model("embeddings"),
    "/v1/rerank": _by_model("rerank"),
    "/rerank": _by_model("rerank"),
    "/v2/rerank": _by_model("rerank"),
    "/v1/score": _by_model("score"),
    "/score": _by_model("score"),
    "/v1/classify": _by_model("classify"),
    "/classify": _by_model("classify"),
    "/pooling": _by_model("pooling"),
    "/tokenize": _by_model("tokenize"),
    "/detokenize": _by_model("detokenize"),
    "/v1/audio/transcriptions": _by_model("transcriptions", "form"),
    "/v1/audio/translations": _by_model("translations", "form"),
}
# A stored response's own paths: GET and DELETE /v1/responses/{id}, POST .../cancel.
STORED_RESPONSES = "/v1/responses/"
STORED = dataclasses.replace(RESPONSES, kind="model")
