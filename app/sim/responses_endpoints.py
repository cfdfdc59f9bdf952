"""`/v1/responses` over HTTP: create (whole, streamed or in the background), retrieve,
delete and cancel, on the engine's load model.

A response is generated like a chat answer (`SimEngine.generate`): its conversation is
rendered and tokenized, so a follow-up naming a `previous_response_id` sends the previous
conversation and answer again and its prompt grows from the same prefix, which the prefix
cache serves. A `previous_response_id` this backend does not hold is vLLM's 404, which is
what a proxy that routed the follow-up to another backend gets.

vLLM mounts create, `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`;
`DELETE /v1/responses/{id}` is OpenAI's, answered as OpenAI does
(`{"id", "object": "response", "deleted": true}`).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from app.errors import ClientError
from app.http.exchange import Exchange
from app.sim.generation import collect
from app.sim.inference import Handler, Inference
from app.sim.kv_transfer import Leg
from app.sim.openai_format import request_error
from app.sim.response_store import ResponseStore, StoredResponse
from app.sim.responses_format import (
    ResponseEvents,
    ResponsesRequest,
    Turn,
    as_messages,
    conversation,
    message_item,
    new_response_id,
    now,
    output_text,
    parse_responses_request,
    response_object,
    response_usage,
)
from app.sim.tokens import render_chat

PREFIX = "/v1/responses/"
JSON = [(b"content-type", b"application/json")]
_RUNNING = ("queued", "in_progress")


@dataclass(frozen=True)
class _Job:
    """One response being made: what it answers and the shape it will have."""

    request: ResponsesRequest
    model: str
    response_id: str
    created_at: int
    prompt: list[int]
    turns: tuple[Turn, ...]
    output_tokens: int
    max_output_tokens: int

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        return response_object(
            self.request,
            response_id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=output,
            usage=usage,
            max_output_tokens=self.max_output_tokens,
        )


class ResponsesEndpoints:
    def __init__(self, inference: Inference, store: ResponseStore | None = None) -> None:
        self.inference = inference
        self.store = store or ResponseStore()
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery background responses run in, for as long as the server serves."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def route(self, path: str) -> dict[str, Handler] | None:
        """The methods of `/v1/responses/{id}` and `/v1/responses/{id}/cancel`."""
        if not path.startswith(PREFIX):
            return None
        response_id, slash, action = path.removeprefix(PREFIX).partition("/")
        if not response_id:
            return None
        if not slash:
            return {
                "GET": partial(self.retrieve, response_id),
                "DELETE": partial(self.delete, response_id),
            }
        if action == "cancel":
            return {"POST": partial(self.cancel, response_id)}
        return None

    async def create(self, exchange: Exchange) -> None:
        inference = self.inference
        payload = await inference.read_json(exchange)
        model = inference.model(payload)
        request = parse_responses_request(payload)
        if request.background and request.stream:
            raise request_error(
                "The simulator does not stream background responses", param="stream"
            )
        job = self._job(request, model)
        if request.background:
            await exchange.respond_json(200, self._start_background(job))
            return
        await inference.admit(len(job.prompt))
        leg = await inference.leg(payload, job.prompt, exchange)
        if leg.output_tokens is not None:  # a prefill engine's one token
            job = dataclasses.replace(job, output_tokens=leg.output_tokens)
        if request.stream:
            await self._stream(job, exchange, leg)
        else:
            await exchange.respond_json(200, await self._whole(job, leg) | leg.answer_fields)

    async def retrieve(self, response_id: str, exchange: Exchange) -> None:
        await exchange.respond(200, JSON, self._stored(response_id).body)

    async def delete(self, response_id: str, exchange: Exchange) -> None:
        stored = self.store.pop(response_id)
        if stored is None:
            raise not_found(response_id)
        if stored.running is not None:
            stored.running.cancel()
        await exchange.respond_json(200, {"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str, exchange: Exchange) -> None:
        """vLLM's: only a background response still running can be cancelled."""
        stored = self._stored(response_id)
        if stored.status not in _RUNNING:
            raise request_error(
                "Cannot cancel a synchronous response.",
                type_="invalid_request_error",
                param="response_id",
            )
        cancelled = stored.set_status("cancelled")
        if stored.running is not None:
            stored.running.cancel()
        await exchange.respond_json(200, cancelled)

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    def _job(self, request: ResponsesRequest, model: str) -> _Job:
        previous: tuple[Turn, ...] = ()
        previous_output: str | None = None
        if request.previous_response_id is not None:
            stored = self._stored(request.previous_response_id)
            previous, previous_output = stored.turns, output_text(stored.response)
        turns = conversation(request, previous, previous_output)
        prompt = self.inference.tokenizer.encode(render_chat(as_messages(turns)))
        limit = self.inference.settings.max_model_len
        if len(prompt) >= limit:
            raise request_error(
                f"The engine prompt length {len(prompt)} exceeds the max_model_len {limit}. "
                "Please reduce prompt.",
                type_="invalid_request_error",
                param="input",
            )
        # vLLM clamps the output to the room the context window leaves.
        room = limit - len(prompt)
        wanted = request.max_output_tokens or self.inference.settings.default_max_tokens
        return _Job(
            request=request,
            model=model,
            response_id=new_response_id(),
            created_at=now(),
            prompt=prompt,
            turns=turns,
            output_tokens=min(wanted, room),
            max_output_tokens=min(request.max_output_tokens or room, room),
        )

    async def _whole(self, job: _Job, leg: Leg | None = None) -> dict[str, Any]:
        pieces = self.inference.pieces(job.prompt)
        engine = self.inference.engine
        text, cached = await collect(engine, job.prompt, job.output_tokens, pieces, leg)
        return self._finish(job, f"msg_{uuid.uuid4().hex}", text, cached)

    async def _stream(self, job: _Job, exchange: Exchange, leg: Leg) -> None:
        pieces = self.inference.pieces(job.prompt)
        item_id = f"msg_{uuid.uuid4().hex}"
        events = ResponseEvents(job.response("in_progress", [], None), item_id)
        await self.inference.stream(
            exchange,
            job.prompt,
            job.output_tokens,
            head=events.head(),
            token=lambda index: events.token(index, next(pieces)),
            tail=lambda cached: events.tail(self._finish(job, item_id, events.text, cached)),
            leg=leg,
        )

    def _finish(self, job: _Job, item_id: str, text: str, cached: int) -> dict[str, Any]:
        """The completed response, stored if asked (a cancelled one stays cancelled)."""
        usage = response_usage(len(job.prompt), job.output_tokens, cached)
        final = job.response("completed", [message_item(item_id, text, "completed")], usage)
        if job.request.store:
            current = self.store.get(job.response_id)
            if current is not None and current.status == "cancelled":
                return current.response
            self.store.put(job.response_id, StoredResponse(final, job.turns))
        return final

    def _start_background(self, job: _Job) -> dict[str, Any]:
        if self._nursery is None:
            raise RuntimeError("ResponsesEndpoints.run must be running for background responses")
        queued = job.response("queued", [], None)
        running = trio.CancelScope()
        self.store.put(job.response_id, StoredResponse(queued, job.turns, running))
        self._nursery.start_soon(self._background, job, running)
        return queued

    async def _background(self, job: _Job, running: trio.CancelScope) -> None:
        with running:
            try:
                await self.inference.admit(len(job.prompt))
                await self._whole(job)
            except ClientError:  # the error fault: the response failed
                stored = self.store.get(job.response_id)
                if stored is not None and stored.status in _RUNNING:
                    stored.set_status("failed")


def not_found(response_id: str) -> ClientError:
    """vLLM's answer for a response id it does not hold."""
    return request_error(
        f"Response with id '{response_id}' not found.",
        status=404,
        type_="invalid_request_error",
        param="response_id",
        code=404,
    )
