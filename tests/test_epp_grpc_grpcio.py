"""The endpoint-picker door's gRPC server against a real gRPC client: grpcio's (C-core's
HTTP/2, not h2's), on 127.0.0.1 port 0, `serve_grpc` in the test's Trio loop and the client's
blocking calls in a worker thread.

Covered: a unary health Check (and NOT_FOUND for an unknown service), a bidi stream echoed
message by message, Watch's first status, an unknown method -> UNIMPLEMENTED, a message over
the server's cap -> RESOURCE_EXHAUSTED, a handler's GrpcError and a handler's bug as the
statuses grpcio reports, and the server still answering after all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import trio

from app.epp.grpc_server import MessageStream, serve_grpc
from app.epp.grpc_wire import GrpcError, Limits, StatusCode
from app.epp.health import CHECK_PATH, WATCH_PATH, HealthService, ServingStatus
from app.epp.messages import HealthCheckRequest, HealthCheckResponse

ECHO = "/test.Echo/Chat"
CAP = 64 * 1024


async def echo(stream: MessageStream) -> None:
    while (message := await stream.receive()) is not None:
        await stream.send(message)


async def refuse(stream: MessageStream) -> None:
    raise GrpcError(StatusCode.PERMISSION_DENIED, "no entry: 100%")


async def crash(stream: MessageStream) -> None:
    raise RuntimeError("a bug")


def code_of(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as error:
        return error.code(), error.details()
    raise AssertionError("the call succeeded")


def client_session(port: int) -> dict[str, Any]:
    """Every call of the test, blocking, from a worker thread: what came back."""
    options = [("grpc.enable_http_proxy", 0)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        raw: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
        check, chat = channel.unary_unary(CHECK_PATH, **raw), channel.stream_stream(ECHO, **raw)

        def health(service: str) -> bytes:
            return bytes(HealthCheckRequest(service=service).SerializeToString())

        def requests() -> Iterator[bytes]:
            yield from (b"one", b"", b"three" * 1000)

        watch = channel.unary_stream(WATCH_PATH, **raw)(health("readiness"))
        first_watched = HealthCheckResponse.FromString(next(watch)).status
        watch.cancel()
        return {
            "check": HealthCheckResponse.FromString(check(health(""))).status,
            "unknown service": code_of(lambda: check(health("nope"))),
            "watch": first_watched,
            "echo": list(chat(requests())),
            "unknown method": code_of(lambda: channel.unary_unary("/no.Such/Method", **raw)(b"")),
            "oversize": code_of(lambda: list(chat(iter([b"x" * (CAP + 1)])))),
            "refused": code_of(lambda: channel.unary_unary("/test.Refuse/It", **raw)(b"")),
            "crashed": code_of(lambda: channel.unary_unary("/test.Crash/It", **raw)(b"")),
            "after": list(chat(iter([b"still here"]))),
        }


async def test_a_grpcio_client_gets_answers_and_statuses() -> None:
    health = HealthService()
    handlers = {
        **health.handlers(),
        ECHO: echo,
        "/test.Refuse/It": refuse,
        "/test.Crash/It": crash,
    }
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_grpc(
                handlers,
                "127.0.0.1",
                0,
                limits=Limits(max_message_bytes=CAP),
                task_status=task_status,
            )
        )
        got = await trio.to_thread.run_sync(client_session, port)
        nursery.cancel_scope.cancel()
    assert got["check"] == ServingStatus.SERVING
    assert got["unknown service"][0] == grpc.StatusCode.NOT_FOUND
    assert got["watch"] == ServingStatus.NOT_SERVING
    assert got["echo"] == [b"one", b"", b"three" * 1000]
    assert got["unknown method"][0] == grpc.StatusCode.UNIMPLEMENTED
    assert got["oversize"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert got["refused"] == (grpc.StatusCode.PERMISSION_DENIED, "no entry: 100%")
    assert got["crashed"][0] == grpc.StatusCode.INTERNAL
    assert got["after"] == [b"still here"]
