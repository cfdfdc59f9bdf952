"""One worker of `sluice serve --workers N`, started by the supervisor as
`python -m app.cli.worker FD`.

FD is the worker's end of a socket pair. The supervisor writes its order there first (the
worker's index and settings, pickled behind an 8-byte length), and the worker answers with one
JSON line once it listens: its pid, the proxy URL and its private dashboard's URL. The channel
then stays open: when the supervisor is gone (killed, even with SIGKILL), the worker reads
end-of-file, finishes its requests within the grace and exits, rather than serve on alone.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import sys
from functools import partial

import trio

from app.cli.serve import run_until_stopped
from app.cli.sluice import Sluice, run_then_cancel, stop_on_signal
from app.cli.supervisor import ORDER_HEADER, WorkerOrder
from app.config import Settings
from app.http.server import HttpServer

log = logging.getLogger("sluice.worker")


def _receive_order(channel: socket.socket) -> WorkerOrder:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = channel.recv(size - len(data))
            if not chunk:
                raise SystemExit("sluice worker: the supervisor hung up before its order")
            data += chunk
        return data

    (size,) = ORDER_HEADER.unpack(exactly(ORDER_HEADER.size))
    order = pickle.loads(exactly(size))
    if not isinstance(order, WorkerOrder):
        raise SystemExit("sluice worker: not an order from the supervisor")
    return order


async def serve_worker(channel: socket.socket, index: int, settings: Settings) -> None:
    sluice = Sluice(settings, server_factory=partial(HttpServer, reuse_port=True), worker=index)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(channel))
    async with stream, trio.open_nursery() as nursery:
        await nursery.start(stop_on_signal, sluice.shutdown, nursery.cancel_scope)
        proxy_url, dashboard_url = await nursery.start(
            run_then_cancel, sluice, nursery.cancel_scope
        )
        hello = {"pid": os.getpid(), "proxy": proxy_url, "dashboard": dashboard_url}
        await stream.send_all(json.dumps(hello).encode() + b"\n")
        nursery.start_soon(_stop_when_orphaned, stream, sluice.shutdown)


async def _stop_when_orphaned(stream: trio.SocketStream, shutdown: trio.Event) -> None:
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass
    if not shutdown.is_set():
        log.warning("the supervisor is gone: finishing in-flight requests, then stopping")
        shutdown.set()


def main(argv: list[str]) -> int:
    channel = socket.socket(fileno=int(argv[1]))
    order = _receive_order(channel)
    return run_until_stopped(
        partial(serve_worker, channel, order.index), order.settings, worker=order.index
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv))
