"""The simulated backend's KV-cache events, published as vLLM publishes them.

`--kv-events-endpoint tcp://HOST:PORT` binds a PUB socket (port 0: any free port) that sends
`[topic, seq, payload]` for every batch of events the prefix cache tells
(`kv_cache.py`), `seq` counting from 0 as 8 big-endian bytes and `payload` encoded as current
vLLM encodes it (app/kv_events/wire.py's `encode_batch`). `--kv-events-replay-endpoint` binds
a ROUTER
socket that keeps the last `REPLAY_BUFFER` messages and answers `[b"", start_seq]` with
every one from `start_seq` on, then the end marker, as vLLM's `ZmqEventPublisher` does.

The `drop_kv_events` fault (`POST /sim/faults`) leaves the next N messages off the PUB
socket, as a full queue would, while the replay buffer keeps them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import cast

import trio
import zmq

from app.kv_events.wire import (
    END_SEQ,
    SEQ_BYTES,
    EventBatch,
    KVEvent,
    encode_batch,
    publish_frames,
)
from app.kv_events.zmq_trio import close_socket, open_socket, receive, send
from app.sim.faults import SimFaults

log = logging.getLogger("sluice.sim.kv_events")

REPLAY_BUFFER = 1000  # messages kept for replay (vLLM's default is 10,000 steps)
TOPIC = b""  # vLLM's default topic


def bindable(endpoint: str) -> str:
    """Port 0 means any free port, which ZMQ spells `*`."""
    return endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint


class SimKvPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, faults: SimFaults) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.faults = faults
        self.published = 0  # the next sequence number
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        self._pub: zmq.Socket[bytes] | None = None

    def publish(self, events: list[KVEvent]) -> None:
        """One batch, sent at once (a PUB socket never blocks: it drops at its high-water
        mark, and the replay buffer still has the message)."""
        seq = self.published
        self.published += 1
        payload = encode_batch(EventBatch(time.time(), tuple(events), data_parallel_rank=0))
        self._buffer.append((seq, payload))
        if self.faults.drop_kv_events:
            self.faults.drop_kv_events -= 1
            return
        if self._pub is not None:
            self._pub.send_multipart(publish_frames(TOPIC, seq, payload), zmq.NOBLOCK)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the bound endpoints (in `endpoint`, `replay_endpoint`), then answer
        replay requests until cancelled."""
        pub = open_socket(zmq.PUB)
        router = open_socket(zmq.ROUTER) if self.replay_endpoint else None
        try:
            pub.bind(bindable(self.endpoint))
            self.endpoint = _bound(pub)
            if router is not None:
                assert self.replay_endpoint is not None
                router.bind(bindable(self.replay_endpoint))
                self.replay_endpoint = _bound(router)
            self._pub = pub
            task_status.started()
            if router is None:
                await trio.sleep_forever()
            else:
                while True:
                    await self._answer(router, await receive(router))
        finally:
            self._pub = None
            close_socket(pub)
            if router is not None:
                close_socket(router)

    async def _answer(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] or len(frames[2]) != SEQ_BYTES:
            log.warning("invalid replay request: %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                await send(router, [client, b"", seq.to_bytes(SEQ_BYTES, "big"), payload])
        await send(router, [client, b"", END_SEQ, b""])


def _bound(sock: zmq.Socket[bytes]) -> str:
    endpoint = cast(bytes, sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
    return endpoint
