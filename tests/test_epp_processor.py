"""The endpoint picker's ext_proc streams, driven message by message (no Envoy, no port for
the picker): a real Sluice's reception and decision behind it, simulated GPUs as its fleet.

Covered: the GIE protocol's answers (the endpoints as header and `envoy.lb` metadata, the
same value, primary first; the request body given back whole in full-duplex mode; buffered
mode), the subset hint obeyed (503 when none of it is eligible), the conformance hooks,
bad input answered as the proxy answers it (as an ImmediateResponse), a shed request's 429
with Retry-After, the served endpoint read back (the reservation moves to a fallback), the
answer followed (first byte, usage, status, the request log), a stream that is not
ext_proc's refused with INVALID_ARGUMENT, and the body chunks the picker reads and writes
by hand byte for byte protobuf's own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import trio

from app.epp import ext_proc
from app.epp.grpc_wire import GrpcError, StatusCode
from app.epp.messages import BUFFERED, FULL_DUPLEX_STREAMED, ProcessingRequest, ProcessingResponse
from app.epp.processor import EndpointPicker
from tests.conftest import MODEL, RunningSluice, StartSim, StartSluice

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there."}]}


class Stream:
    """A `MessageStream` whose other end is the test."""

    def __init__(self) -> None:
        self._to_picker, self._inbox = trio.open_memory_channel[bytes](100)
        self._outbox, self._from_picker = trio.open_memory_channel[bytes](100)
        self.metadata: list[tuple[bytes, bytes]] = []

    async def receive(self) -> bytes | None:
        try:
            return await self._inbox.receive()
        except trio.EndOfChannel:
            return None

    async def send(self, message: bytes) -> None:
        await self._outbox.send(message)

    def send_initial_metadata(self) -> None:
        """Response headers are the transport's: nothing to prepare here."""

    async def put(self, request: Any) -> None:
        await self._to_picker.send(request.SerializeToString())

    async def end(self) -> None:
        await self._to_picker.aclose()

    async def answer(self) -> Any:
        return ProcessingResponse.FromString(await self._from_picker.receive())


def headers_message(
    path: str = "/v1/chat/completions",
    extra: Sequence[tuple[str, str]] = (),
    *,
    mode: int = FULL_DUPLEX_STREAMED,
    end: bool = False,
    subset: list[str] | None = None,
    method: str = "POST",
) -> Any:
    message = ProcessingRequest()
    fields = [(":method", method), (":path", path), ("content-type", "application/json")]
    for key, value in [*fields, *extra]:
        message.request_headers.headers.headers.add(key=key, raw_value=value.encode())
    message.request_headers.end_of_stream = end
    message.protocol_config.request_body_mode = mode
    if subset is not None:
        message.metadata_context.filter_metadata[ext_proc.SUBSET_NAMESPACE].update(
            {ext_proc.SUBSET: subset}
        )
    return message


def body_message(body: bytes, end: bool = True) -> Any:
    message = ProcessingRequest()
    message.request_body.body = body
    message.request_body.end_of_stream = end
    return message


def response_headers(status: int = 200, served: str | None = None) -> Any:
    message = ProcessingRequest()
    message.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
    if served is not None:
        message.metadata_context.filter_metadata[ext_proc.LB_NAMESPACE].update(
            {ext_proc.SERVED: served}
        )
    return message


def response_body(body: bytes, end: bool) -> Any:
    message = ProcessingRequest()
    message.response_body.body = body
    message.response_body.end_of_stream = end
    return message


def destination(answer: Any, phase: str = "request_headers") -> str:
    mutation = getattr(answer, phase).response.header_mutation
    values = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    metadata = answer.dynamic_metadata.fields[ext_proc.LB_NAMESPACE].struct_value
    assert metadata.fields[ext_proc.DESTINATION].string_value == values[ext_proc.DESTINATION]
    return values[ext_proc.DESTINATION]


def immediate(answer: Any) -> tuple[int, dict[str, Any], dict[str, bytes]]:
    reply = answer.immediate_response
    headers = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}
    return reply.status.code, json.loads(reply.body), headers


@pytest.fixture
async def fleet(start_sim: StartSim, start_sluice: StartSluice) -> RunningSluice:
    sims = [await start_sim() for _ in range(3)]
    return await start_sluice([sim.url for sim in sims])


def picker_of(running: RunningSluice) -> EndpointPicker:
    sluice = running.sluice
    return EndpointPicker(
        sluice.reception,
        sluice.decider,
        sluice.pool,
        sluice.metrics.doors,
        sluice.settings.max_body_bytes,
    )


async def test_a_chat_is_routed_primary_first_and_its_body_given_back_whole(
    fleet: RunningSluice, nursery: trio.Nursery
) -> None:
    picker, stream = picker_of(fleet), Stream()
    nursery.start_soon(picker.process, stream)
    body = json.dumps(CHAT).encode()
    await stream.put(headers_message())
    # The body in two chunks, as Envoy streams it: nothing is answered before the last.
    await stream.put(body_message(body[:10], end=False))
    await stream.put(body_message(body[10:]))
    routed = await stream.answer()
    endpoints = destination(routed).split(",")
    pool = {backend.endpoint: backend for backend in fleet.sluice.pool.backends}
    assert len(endpoints) == 3 and set(endpoints) == set(pool)
    assert routed.request_headers.response.clear_route_cache
    given_back = (await stream.answer()).request_body.response.body_mutation.streamed_response
    assert given_back.body == body and given_back.end_of_stream
    primary = pool[endpoints[0]]
    assert primary.inflight == 1
    # The answer, as Envoy passes it on: followed, given back, and its usage counted.
    await stream.put(response_headers(200, served=endpoints[0]))
    headers = (await stream.answer()).response_headers.response.header_mutation.set_headers
    assert {h.header.key for h in headers} >= {
        "x-sluice-backend",
        "x-sluice-route",
        "server-timing",
    }
    usage = b'{"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}'
    await stream.put(response_body(usage, end=True))
    chunk = (await stream.answer()).response_body.response.body_mutation.streamed_response
    assert chunk.body == usage and chunk.end_of_stream
    await stream.end()
    await wait_for(lambda: primary.inflight == 0)
    record = fleet.sluice.metrics.traffic.log.recent()[-1]
    assert record["status"] == 200 and record["backend"] == primary.url


async def wait_for(predicate: Any) -> None:
    with trio.fail_after(5):
        while not predicate():
            await trio.sleep(0.005)


async def test_buffered_mode_answers_the_headers_at_once_and_routes_with_the_body(
    fleet: RunningSluice, nursery: trio.Nursery
) -> None:
    picker, stream = picker_of(fleet), Stream()
    nursery.start_soon(picker.process, stream)
    await stream.put(headers_message(mode=BUFFERED))
    proceed = await stream.answer()
    assert proceed.WhichOneof("response") == "request_headers"
    assert not proceed.request_headers.response.header_mutation.set_headers
    await stream.put(body_message(json.dumps(CHAT).encode()))
    routed = await stream.answer()
    assert routed.WhichOneof("response") == "request_body"
    assert destination(routed, "request_body")
    await stream.end()


async def test_the_subset_hint_is_obeyed_and_an_empty_one_is_a_503(
    fleet: RunningSluice, nursery: trio.Nursery
) -> None:
    picker = picker_of(fleet)
    chosen = fleet.sluice.pool.backends[2].endpoint
    for _ in range(4):
        stream = Stream()
        nursery.start_soon(picker.process, stream)
        await stream.put(headers_message(subset=[chosen, "10.9.9.9:80"]))
        await stream.put(body_message(json.dumps(CHAT).encode()))
        assert destination(await stream.answer()) == chosen  # no fallback outside the subset
        await stream.end()
    stream = Stream()
    nursery.start_soon(picker.process, stream)
    await stream.put(headers_message(subset=["10.9.9.9:80"]))
    await stream.put(body_message(json.dumps(CHAT).encode()))
    status, body, headers = immediate(await stream.answer())
    assert status == 503 and body["error"]["code"] == "no_healthy_backend"
    assert headers["retry-after"]


async def test_a_disaggregated_fleets_requests_go_whole_to_its_engines_that_do_both(
    start_sim: StartSim, start_sluice: StartSluice, nursery: trio.Nursery
) -> None:
    prefill, decode, both = [await start_sim() for _ in range(3)]
    running = await start_sluice([both.url], prefill=(prefill.url,), decode=(decode.url,))
    picker = picker_of(running)
    for _ in range(3):
        stream = Stream()
        nursery.start_soon(picker.process, stream)
        await stream.put(headers_message())
        await stream.put(body_message(json.dumps(CHAT).encode()))
        assert destination(await stream.answer()) == both.url.removeprefix("http://")
        await stream.end()


async def test_the_conformance_hooks_pick_the_named_endpoint_and_say_which_served(
    fleet: RunningSluice, nursery: trio.Nursery
) -> None:
    picker, stream = picker_of(fleet), Stream()
    named = fleet.sluice.pool.backends[1].endpoint
    nursery.start_soon(picker.process, stream)
    await stream.put(headers_message(extra=[("test-epp-endpoint-selection", named)]))
    await stream.put(body_message(json.dumps(CHAT).encode()))
    assert destination(await stream.answer()) == named
    await stream.answer()  # the body
    await stream.put(response_headers(200, served=named))
    headers = (await stream.answer()).response_headers.response.header_mutation.set_headers
    assert {h.header.key: h.header.raw_value for h in headers}[ext_proc.TEST_SERVED] == (
        named.encode()
    )
    await stream.end()


@pytest.mark.parametrize(
    "body",
    [b"{not json", json.dumps({"messages": CHAT["messages"]}).encode(), b'{"model": "nope"}'],
    ids=["not-json", "no-model", "unknown-model"],
)
async def test_bad_input_gets_the_proxys_own_answer_as_an_immediate_response(
    start_sim: StartSim,
    start_sluice: StartSluice,
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    body: bytes,
) -> None:
    # Two models: a request must name one.
    sims = [await start_sim(), await start_sim(models=("other",))]
    fleet = await start_sluice([sim.url for sim in sims])
    picker, stream = picker_of(fleet), Stream()
    nursery.start_soon(picker.process, stream)
    await stream.put(headers_message())
    await stream.put(body_message(body))
    status, answer, headers = immediate(await stream.answer())
    proxied = await client.post(
        f"{fleet.proxy_url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert (status, answer) == (proxied.status_code, proxied.json())
    assert 400 <= status < 500 and headers["content-type"] == b"application/json"


async def test_a_shed_request_gets_429_with_retry_after(
    start_sim: StartSim, start_sluice: StartSluice, nursery: trio.Nursery
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url], admission_timeout=0.05, max_inflight_per_backend=1)
    picker = picker_of(running)
    first, second = Stream(), Stream()
    nursery.start_soon(picker.process, first)
    await first.put(headers_message())
    await first.put(body_message(json.dumps(CHAT).encode()))
    assert destination(await first.answer())
    # The backend's one place is taken: the next is held in its stream, then refused.
    nursery.start_soon(picker.process, second)
    await second.put(headers_message())
    await second.put(body_message(json.dumps(CHAT).encode()))
    status, body, headers = immediate(await second.answer())
    assert status == 429 and body["error"]["code"] == "queue_timeout"
    assert int(headers["retry-after"]) >= 1
    await first.end()


async def test_a_request_served_by_a_fallback_moves_its_reservation_there(
    fleet: RunningSluice, nursery: trio.Nursery
) -> None:
    picker, stream = picker_of(fleet), Stream()
    nursery.start_soon(picker.process, stream)
    await stream.put(headers_message())
    await stream.put(body_message(json.dumps(CHAT).encode()))
    endpoints = destination(await stream.answer()).split(",")
    await stream.answer()
    by_endpoint = {backend.endpoint: backend for backend in fleet.sluice.pool.backends}
    primary, fallback = by_endpoint[endpoints[0]], by_endpoint[endpoints[1]]
    assert (primary.inflight, fallback.inflight) == (1, 0)
    await stream.put(response_headers(200, served=endpoints[1]))
    await stream.answer()
    assert (primary.inflight, fallback.inflight) == (0, 1)
    await stream.end()
    await wait_for(lambda: fallback.inflight == 0)


async def test_a_stream_that_is_not_ext_proc_is_refused(fleet: RunningSluice) -> None:
    picker, stream = picker_of(fleet), Stream()
    await stream._to_picker.send(b"\xff\xff\xff")
    with pytest.raises(GrpcError) as refused:
        await picker.process(stream)
    assert refused.value.code == StatusCode.INVALID_ARGUMENT


async def test_a_stream_that_begins_with_a_body_is_refused(fleet: RunningSluice) -> None:
    picker, stream = picker_of(fleet), Stream()
    await stream.put(body_message(b"{}"))
    with pytest.raises(GrpcError) as refused:
        await picker.process(stream)
    assert refused.value.code == StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("size", [0, 1, 127, 128, 20_000])
@pytest.mark.parametrize("end", [False, True])
def test_body_chunks_read_and_written_by_hand_are_protobufs_own(size: int, end: bool) -> None:
    body = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    for phase in ("request_body", "response_body"):
        expected = ProcessingResponse()
        chunk = getattr(expected, phase).response.body_mutation.streamed_response
        chunk.body, chunk.end_of_stream = body, end
        assert ext_proc.streamed(phase, body, end) == expected.SerializeToString()
    request = ProcessingRequest()
    request.response_body.body, request.response_body.end_of_stream = body, end
    data = request.SerializeToString()
    assert ext_proc.response_body_chunk(data) == (body, end)
    # Anything else, or anything more, is left to protobuf.
    request.metadata_context.filter_metadata["envoy.lb"].update({"a": "b"})
    assert ext_proc.response_body_chunk(request.SerializeToString()) is None
    assert ext_proc.response_body_chunk(data[:-1]) is None
    assert ext_proc.response_body_chunk(headers_message().SerializeToString()) is None
