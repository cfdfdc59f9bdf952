"""A minimal HTTP/1.1 keep-alive client on Trio sockets, for overhead measurements.

On a 2-core machine the load generator shares the CPU with what it measures; httpx spends
about as much CPU per request as the proxy under test, so a closed loop measures the client.
This one sends pre-built request bytes and reads `content-length` or chunked answers,
nothing else: a fraction of httpx's cost, and the same for every target.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import trio


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
