"""ZeroMQ sockets on the Trio loop, never blocking it.

libzmq does its networking in its own I/O thread; the loop only moves whole messages in and
out of a socket's queues, without blocking (`zmq.NOBLOCK`). A socket's `zmq.FD` becomes
readable when the socket's state *changes* (edge-triggered), and only after `zmq.EVENTS` has
been read: so the events are read first, and the loop waits on the descriptor only while
they say the socket is not ready, as libzmq's documentation asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import trio
import zmq

# One message may be this large: a scheduler step's events are kilobytes (a 16k-token
# prefill: ~80 KB of token ids and ~35 KB of sha256 hashes); a peer that sends more is cut.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process's one ZMQ context (its I/O thread serves every socket)."""
    return zmq.Context.instance()


def open_socket(kind: int, *, receive_hwm: int = 1000) -> zmq.Socket[bytes]:
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVHWM, receive_hwm)
    # A peer that is down is retried at most every 5 s (from 100 ms), without end.
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
    return sock


def close_socket(sock: zmq.Socket[bytes]) -> None:
    """Close, waking (with ClosedResourceError) any task still waiting on the socket."""
    if sock.closed:
        return
    trio.lowlevel.notify_closing(sock.fileno())
    sock.close(linger=0)


async def _ready(sock: zmq.Socket[bytes], flag: int) -> None:
    while not cast(int, sock.getsockopt(zmq.EVENTS)) & flag:
        await trio.lowlevel.wait_readable(sock.fileno())


async def receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    """The next whole message (all its frames)."""
    await trio.lowlevel.checkpoint()  # a flood of ready messages still lets others run
    await _ready(sock, zmq.POLLIN)
    return sock.recv_multipart(zmq.NOBLOCK)


async def send(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    await trio.lowlevel.checkpoint()
    await _ready(sock, zmq.POLLOUT)
    sock.send_multipart(frames, zmq.NOBLOCK)
