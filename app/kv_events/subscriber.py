"""Subscribing to one engine's KV events (`--kv-events BACKEND_URL=ENDPOINT`) on the Trio loop.

A SUB socket connects to the engine's publisher (ZMQ reconnects by itself while the engine
is down: a dead endpoint is only silence) and each message is decoded (`wire.py`)
and applied to the backend's index (`index.py`). When sequence numbers skip, the
lost messages are asked of the engine's replay socket (`--kv-events-replay`), with a time
limit; what cannot be replayed is rebuilt: the backend's index is cleared and left to
prediction and the next events. A message that cannot be decoded is counted and dropped,
and never stops the subscriber. Once a second without a message, the subscriber looks
whether the publisher fell silent while requests flowed, and says so when that changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from functools import partial

import trio
import zmq

from app.fleet.pool import BackendPool
from app.kv_events.index import BackendKvEvents, KvEventsState
from app.kv_events.wire import (
    BadMessage,
    decode_batch,
    replay_request,
    split_frames,
    split_replay_frames,
)
from app.kv_events.zmq_trio import close_socket, open_socket, receive, send
from app.routing.cache_aware import CacheAware
from app.routing.decision import Policy

log = logging.getLogger("sluice.kv_events")

# Replay gives up after this long (the engine's replay socket may be gone with its engine).
REPLAY_TIMEOUT = 2.0
# A gap longer than this is rebuilt without asking: vLLM keeps 10,000 steps for replay.
MAX_REPLAY = 10_000
SILENCE_CHECK_INTERVAL = 1.0
# Bad messages are logged the first time and then once per this many.
LOG_EVERY_BAD = 1000


class KvEventsSnapshot(KvEventsState):
    """A backend's `kv_events` block in the dashboard's snapshot."""

    endpoint: str
    replay_endpoint: str | None


class KvEventSubscriber:
    def __init__(
        self,
        url: str,
        endpoint: str,
        replay_endpoint: str | None,
        events: BackendKvEvents,
        wanted: Callable[[], bool] = lambda: True,
    ) -> None:
        """`wanted` says whether the backend is still in the pool (one removed at run time
        keeps its subscriber, which ignores it until it is added again)."""
        self.url = url
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.events = events
        self.wanted = wanted
        self._source = "predicted"  # what the log last said

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        sub = open_socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")  # one publisher per endpoint: every topic
            sub.connect(self.endpoint)
            log.info("backend %s: listening for KV events at %s", self.url, self.endpoint)
            task_status.started()
            while True:
                frames: list[bytes] | None = None
                with trio.move_on_after(SILENCE_CHECK_INTERVAL):
                    frames = await receive(sub)
                if frames is not None:
                    await self.handle(frames)
                self._check_silence()
        finally:
            close_socket(sub)

    async def handle(self, frames: list[bytes]) -> None:
        """One message from the PUB socket."""
        events = self.events
        if not self.wanted():
            if events.last_seq is not None:
                events.clear()
                events.last_seq = None
            return
        try:
            _, seq, payload = split_frames(frames)
            batch = decode_batch(payload)
        except BadMessage as exc:
            self._bad(exc)
            return
        continuity = events.continuity(seq)
        if continuity == "restart":
            log.warning(
                "backend %s: KV event sequence went back from %s to %d (engine restarted): "
                "its index starts again",
                self.url,
                events.last_seq,
                seq,
            )
            events.restart()
        elif continuity == "gap":
            await self._fill_gap(seq)
        events.apply(seq, batch, trio.current_time(), time.time())

    async def _fill_gap(self, seq: int) -> None:
        events = self.events
        missing = events.missing(seq)
        how = "no replay endpoint"
        if self.replay_endpoint is not None and len(missing) <= MAX_REPLAY:
            replayed = await self._replay(missing)
            if replayed == len(missing):
                events.gaps["replayed"] += 1
                log.info("backend %s: %d lost KV event messages replayed", self.url, replayed)
                return
            how = f"replay gave {replayed}"
        elif self.replay_endpoint is not None:
            how = "too many to replay"
        events.rebuild()
        log.warning(
            "backend %s: %d KV event messages lost (%s): index rebuilt from prediction",
            self.url,
            len(missing),
            how,
        )

    async def _replay(self, missing: range) -> int:
        """Ask the replay socket for `missing` and apply it in order; how many were."""
        assert self.replay_endpoint is not None
        dealer = open_socket(zmq.DEALER)
        applied = 0
        try:
            dealer.connect(self.replay_endpoint)
            with trio.move_on_after(REPLAY_TIMEOUT):
                await send(dealer, replay_request(missing.start))
                while applied < len(missing):
                    answer = split_replay_frames(await receive(dealer))
                    if answer is None:
                        break
                    seq, payload = answer
                    if seq < missing.start + applied:
                        continue
                    if seq != missing.start + applied:
                        break  # the engine's buffer no longer has it
                    self.events.apply(seq, decode_batch(payload), trio.current_time(), time.time())
                    applied += 1
        except (BadMessage, zmq.ZMQError) as exc:
            self._bad(exc)
        finally:
            close_socket(dealer)
        return applied

    def snapshot(self, now: float) -> KvEventsSnapshot:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            **self.events.snapshot(now),
        }

    def _bad(self, exc: Exception) -> None:
        self.events.bad_messages += 1
        count = self.events.bad_messages
        if count == 1 or count % LOG_EVERY_BAD == 0:
            log.warning("backend %s: bad KV event message (%d so far): %s", self.url, count, exc)

    def _check_silence(self) -> None:
        now = trio.current_time()
        source = self.events.source(now)
        if source == self._source:
            return
        if source == "events":
            log.info("backend %s: KV events flowing: the index follows them", self.url)
        else:
            silence = self.events.silence(now)
            log.warning("backend %s: KV events %s: routing on prediction", self.url, silence)
        self._source = source


def subscribers_for(
    endpoints: Mapping[str, tuple[str, str | None]],
    max_index_blocks: int,
    pool: BackendPool,
    policy: Policy,
) -> dict[str, KvEventSubscriber]:
    """One subscriber per backend given `--kv-events` (`endpoints`: backend URL ->
    publisher, replay or None), each feeding `policy`'s index; the engine-block maps share
    `--max-index-blocks` between them."""
    if not endpoints or not isinstance(policy, CacheAware):
        return {}
    share = max(1, max_index_blocks // len(endpoints))
    subscribers: dict[str, KvEventSubscriber] = {}
    for url, (endpoint, replay) in endpoints.items():
        backend = pool.find(url)
        assert backend is not None  # Settings checked every URL against --backend
        events = BackendKvEvents(policy.index, backend.id, share)
        subscribers[url] = KvEventSubscriber(
            url, endpoint, replay, events, wanted=partial(_in_pool, pool, url)
        )
    return subscribers


def _in_pool(pool: BackendPool, url: str) -> bool:
    return pool.find(url) is not None
