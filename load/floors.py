"""Servers that do nothing but answer, for `bench overhead`: what the HTTP server alone costs.

    python -m load.floors hypercorn PORT   # an ASGI app on hypercorn's Trio worker, as Sluice
    python -m load.floors h11 PORT         # h11 on bare Trio streams: one task a connection

Both answer every POST with the same small chat completion, no backend behind them, so the
CPU they spend per request is the floor under any proxy built on that server. Sluice serves
its dashboard with the first; its data port's own server (app/http/) is measured against
the second.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import h11
import trio
from hypercorn.trio import serve

from app.dashboard.serving import server_config

ANSWER = json.dumps(
    {
        "id": "chatcmpl-floor",
        "object": "chat.completion",
        "model": "sim",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }
).encode()
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
MAX_BODY_BYTES = 1 << 20


async def answer_asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Startup and shutdown acknowledged; every request's body read, then the answer."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if message["type"] == "http.disconnect" or size > MAX_BODY_BYTES:
            return
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


async def answer_h11(stream: trio.SocketStream) -> None:
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_BODY_BYTES)
    async with stream:
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                connection.receive_data(data)
            elif isinstance(event, h11.EndOfMessage):
                response = h11.Response(status_code=200, headers=HEADERS)
                payload = b"".join(
                    connection.send(part) or b""
                    for part in (response, h11.Data(data=ANSWER), h11.EndOfMessage())
                )
                await stream.send_all(payload)
                connection.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return


async def run(kind: str, port: int) -> None:
    if kind == "hypercorn":
        app: Any = answer_asgi
        await serve(app, server_config("127.0.0.1", port, 2048))
    else:
        await trio.serve_tcp(answer_h11, port, host="127.0.0.1")


if __name__ == "__main__":
    trio.run(run, sys.argv[1], int(sys.argv[2]))
