"""The small-request client (app/http/fetch.py) against a raw TCP server on port 0: a GET, a
JSON POST and a PUT with a header of the caller's read whole over one kept-alive connection;
an answer over the bound, or cut short by the backend, is an `UpstreamError` and its
connection is not reused."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial

import pytest
import trio

from app.errors import UpstreamError
from app.http.fetch import Fetcher

Answer = Callable[[bytes], bytes]


class RawServer:
    """Answers each request head (and body) it reads with `answer(request)`; counts its
    connections. `close_after` answers close the connection."""

    def __init__(self, answer: Answer, close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = b""
        async with stream:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buffer += data
                head, separator, rest = buffer.partition(b"\r\n\r\n")
                if not separator:
                    continue
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                if len(rest) < length:
                    continue
                request, buffer = head + b"\r\n\r\n" + rest[:length], rest[length:]
                self.requests.append(request)
                await stream.send_all(self.answer(request))
                if self.close_after:
                    return


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)


async def serve(nursery: trio.Nursery, server: RawServer) -> str:
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def test_a_get_and_a_json_post_are_read_whole_over_one_connection(
    nursery: trio.Nursery,
) -> None:
    server = RawServer(lambda request: ok(b'{"tokens": [1, 2]}'))
    url = await serve(nursery, server)
    fetcher = Fetcher(connect_timeout=5.0)
    got = await fetcher.get(url, "/metrics")
    assert (got.status, got.json()) == (200, {"tokens": [1, 2]})
    posted = await fetcher.post_json(url, "/tokenize", {"prompt": "hi"})
    assert posted.text == '{"tokens": [1, 2]}'
    token = [(b"authorization", b"Bearer t")]
    assert (await fetcher.put_json(url, "/api/policy", {"saturation": "wait"}, token)).ok
    assert server.connections == 1
    get, post, put = server.requests
    assert get.startswith(b"GET /metrics HTTP/1.1\r\n")
    assert b"content-type: application/json" in post
    assert json.loads(post.partition(b"\r\n\r\n")[2]) == {"prompt": "hi"}
    assert put.startswith(b"PUT /api/policy HTTP/1.1\r\n") and b"authorization: Bearer t" in put
    await fetcher.aclose()


async def test_an_answer_over_the_bound_is_refused_and_its_connection_closed(
    nursery: trio.Nursery,
) -> None:
    server = RawServer(lambda request: ok(b"x" * 5000))
    url = await serve(nursery, server)
    fetcher = Fetcher(connect_timeout=5.0, max_answer_bytes=1000)
    with pytest.raises(UpstreamError, match="over 1000 bytes"):
        await fetcher.get(url, "/metrics")
    fetcher.max_answer_bytes = 10_000
    assert (await fetcher.get(url, "/metrics")).body == b"x" * 5000
    assert server.connections == 2  # the refused answer's connection was not reused
    await fetcher.aclose()


@pytest.mark.parametrize("split", ["whole", "byte by byte"])
async def test_an_answer_cut_short_is_an_error(nursery: trio.Nursery, split: str) -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b"

    class Cutting(RawServer):
        async def handle(self, stream: trio.SocketStream) -> None:
            async with stream:
                await stream.receive_some(65536)
                pieces = [cut] if split == "whole" else [cut[i : i + 1] for i in range(len(cut))]
                for piece in pieces:
                    await stream.send_all(piece)

    url = await serve(nursery, Cutting(ok))
    fetcher = Fetcher(connect_timeout=5.0)
    with pytest.raises(UpstreamError):
        await fetcher.get(url, "/health")
    await fetcher.aclose()
