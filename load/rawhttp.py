"""A minimal HTTP/1.1 keep-alive client on Trio sockets, and the loads the CPU benchmarks
drive with it: open loop at a rate, closed loop for a while.

On a 2-core machine the load generator shares the CPU with what it measures; httpx spends
about as much CPU per request as the proxy under test, so a closed loop measures the client.
This one sends pre-built request bytes and reads `content-length` or chunked answers,
nothing else: a fraction of httpx's cost, and the same for every target.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit

import trio

from load import arrivals

CHAT = "/v1/chat/completions"
# The overhead scenario's request: one non-streaming one-token chat.
ONE_TOKEN = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Say one word."}],
    "max_tokens": 1,
}
ERRORS = (OSError, trio.BrokenResourceError, ConnectionError, ValueError, IndexError)


class RawConnection:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.stream: trio.SocketStream | None = None
        self.buffer = b""

    @staticmethod
    def request(url: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        parts = urlsplit(url)
        lines = [
            f"POST {path} HTTP/1.1",
            f"host: {parts.netloc}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def _fill(self) -> None:
        assert self.stream is not None
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("connection closed")
        self.buffer += data

    async def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            await self._fill()
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    async def _read_exact(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._fill()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    async def send(self, request: bytes) -> int:
        """Send one request, read the whole response; returns the status code."""
        if self.stream is None:
            self.stream = await trio.open_tcp_stream(self.host, self.port)
            self.buffer = b""
        try:
            await self.stream.send_all(request)
            head = (await self._read_until(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            status = int(head[0].split()[1])
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])
            }
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await self._read_until(b"\r\n")).split(b";")[0], 16)
                    await self._read_exact(size + 2)
                    if size == 0:
                        break
            else:
                await self._read_exact(int(headers.get("content-length", "0")))
            if headers.get("connection", "").lower() == "close":
                await self.close()
            return status
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.aclose()


class Pool:
    """Idle keep-alive connections to one target, reused as a client library would."""

    def __init__(
        self, url: str, headers: dict[str, str] | None = None, body: dict[str, Any] = ONE_TOKEN
    ) -> None:
        self.url = url
        self.request = RawConnection.request(url, CHAT, json.dumps(body).encode(), headers or {})
        self.idle: list[RawConnection] = []

    async def send(self) -> int:
        """One request; a pooled connection the server closed meanwhile is retried once."""
        reused = bool(self.idle)
        connection = self.idle.pop() if reused else RawConnection(self.url)
        try:
            status = await connection.send(self.request)
        except ERRORS:
            if not reused:
                raise
            connection = RawConnection(self.url)
            status = await connection.send(self.request)
        self.idle.append(connection)
        return status

    async def warm(self, requests: int = 50) -> None:
        """Open connections and pay first-request costs before anything is measured."""
        for _ in range(requests):
            await self.send()

    async def close(self) -> None:
        for connection in self.idle:
            await connection.close()


async def open_loop(pool: Pool, rate: float, seconds: float, seed: int) -> tuple[list[float], int]:
    """Poisson arrivals at `rate` for `seconds`, each its own task: (latencies of the 200s,
    errors)."""
    latencies: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        sent = time.perf_counter()
        try:
            status = await pool.send()
        except ERRORS:
            errors += 1
            return
        if status == 200:
            latencies.append(time.perf_counter() - sent)
        else:
            errors += 1

    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        for at in arrivals.schedule("poisson", rate, seconds, seed):
            await trio.sleep_until(t0 + at)
            nursery.start_soon(one)
    return latencies, errors


async def closed_loop(pool: Pool, clients: int, seconds: float) -> tuple[int, int, float]:
    """`clients` workers, each on its own keep-alive connection, sending the next request when
    the last is answered: (answered 200, errors, wall seconds)."""
    done = errors = 0
    deadline = trio.current_time() + seconds

    async def worker() -> None:
        nonlocal done, errors
        connection = RawConnection(pool.url)
        try:
            while trio.current_time() < deadline:
                try:
                    status = await connection.send(pool.request)
                except ERRORS:
                    errors += 1
                    await trio.sleep(0.01)
                    continue
                done += status == 200  # not `done += await ...`: that reads `done` first
                errors += status != 200
        finally:
            await connection.close()

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(worker)
    return done, errors, time.perf_counter() - started
