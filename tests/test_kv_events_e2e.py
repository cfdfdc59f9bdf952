"""KV events over real ZMQ sockets on 127.0.0.1 (free ports): the simulated backend publishes
what its prefix cache stores and evicts, a subscriber keeps an index from it alone, lost
messages come back from the replay socket (or the index is rebuilt without one), and
`POST /sim/evict` empties it; a publisher that sends garbage or restarts, and an endpoint
nobody listens on, never take the proxy down; an engine whose token ids are not Sluice's
is reported unmatched; and through a whole Sluice: after an eviction the next request for
that prefix is not sent to that backend as a prefix hit, and the events' numbers show in
/metrics and /api/snapshot."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import zmq

from app.kv_events.index import BackendKvEvents
from app.kv_events.subscriber import KvEventSubscriber
from app.kv_events.wire import (
    BlockStored,
    EventBatch,
    encode_batch,
    publish_frames,
)
from app.kv_events.zmq_trio import close_socket, open_socket, send
from app.routing.block_index import BlockIndex, block_hashes
from tests.conftest import SimHandle, StartSim, StartSluice, set_faults, wait_until

ANY_PORT = "tcp://127.0.0.1:0"


def subscribe(
    nursery: trio.Nursery, endpoint: str, replay: str | None = None
) -> tuple[BlockIndex, KvEventSubscriber]:
    index = BlockIndex(10_000)
    subscriber = KvEventSubscriber("sim", endpoint, replay, BackendKvEvents(index, "gpu", 10_000))
    nursery.start_soon(subscriber.run)
    return index, subscriber


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int]) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    response = await client.post(url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text


def prompt(number: int, blocks: int = 4) -> list[int]:
    return [(100 * number + i) % 129_000 for i in range(16 * blocks)]


async def until_listening(
    client: httpx.AsyncClient, sim: SimHandle, *subscribers: KvEventSubscriber
) -> None:
    """ZMQ drops what a PUB sends before a SUB's connection is up: prompt until every
    subscriber has heard something."""
    number = 500

    async def heard() -> bool:
        nonlocal number
        number += 1
        await complete(client, sim.url, prompt(number, 1))
        return all(s.events.batches for s in subscribers)

    await wait_until(heard)


async def test_an_index_kept_from_the_sims_events_replays_gaps_and_learns_an_eviction(
    nursery: trio.Nursery, start_sim: StartSim, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(kv_events_endpoint=ANY_PORT, kv_events_replay_endpoint=ANY_PORT)
    publisher = sim.app.kv_publisher
    assert publisher is not None and publisher.endpoint != ANY_PORT
    index, with_replay = subscribe(nursery, publisher.endpoint, publisher.replay_endpoint)
    other_index, without_replay = subscribe(nursery, publisher.endpoint)
    await until_listening(client, sim, with_replay, without_replay)

    await complete(client, sim.url, prompt(1))
    hashes = block_hashes(prompt(1))

    async def learned() -> bool:
        return index.match("gpu", hashes) == 4 and other_index.match("gpu", hashes) == 4

    await wait_until(learned)

    # Two messages lost on the way: replayed for one subscriber, rebuilt for the other.
    await set_faults(client, sim.url, drop_kv_events=2)
    for number in (2, 3, 4):
        await complete(client, sim.url, prompt(number))

    async def caught_up() -> bool:
        last = publisher.published - 1
        return with_replay.events.last_seq == without_replay.events.last_seq == last

    await wait_until(caught_up)
    assert with_replay.events.gaps == {"replayed": 1}
    assert all(index.match("gpu", block_hashes(prompt(n))) == 4 for n in (1, 2, 3, 4))
    assert without_replay.events.gaps == {"rebuilt": 1}
    assert other_index.match("gpu", hashes) == 0  # cleared, then only what came after
    assert other_index.match("gpu", block_hashes(prompt(4))) == 4

    # POST /sim/evict: AllBlocksCleared, and the index is empty.
    response = await client.post(sim.url + "/sim/evict")
    assert response.json()["evicted_blocks"] > 0

    async def cleared() -> bool:
        return index.blocks("gpu") == 0 and other_index.blocks("gpu") == 0

    await wait_until(cleared)
    assert with_replay.events.events["cleared"] == 1
    state = (await client.get(sim.url + "/sim/state")).json()
    assert state["kv_events"]["published"] == publisher.published


@pytest.fixture
async def raw_publisher() -> AsyncIterator[tuple[zmq.Socket[bytes], str]]:
    pub = open_socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    try:
        yield pub, pub.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
    finally:
        close_socket(pub)


def batch(number: int) -> bytes:
    ids = tuple(range(number * 100, number * 100 + 16))
    return encode_batch(EventBatch(1.0, (BlockStored((number,), None, ids, 16),)))


async def test_garbage_and_restarts_are_counted_and_never_stop_the_subscriber(
    nursery: trio.Nursery, raw_publisher: tuple[zmq.Socket[bytes], str]
) -> None:
    pub, endpoint = raw_publisher
    index, subscriber = subscribe(nursery, endpoint)
    events = subscriber.events
    seq = 0

    async def heard() -> bool:
        nonlocal seq
        await send(pub, publish_frames(b"kv", seq, batch(seq)))
        seq += 1
        return events.batches > 0

    await wait_until(heard)
    garbage = [
        [b"only one frame"],
        [b"kv", b"short", batch(1)],
        [b"kv", (seq).to_bytes(8, "big"), b"\xc1 not msgpack"],
        [b"kv", (seq).to_bytes(8, "big"), b"\x91" * 50_000],
        [b"kv", (seq).to_bytes(8, "big"), b"\x92\x01\x91\x92\xabBlockStored\x01"],
    ]
    for frames in garbage:
        await send(pub, frames)
    # Then a good message a step later (the bad one at `seq` counts as lost: no replay here),
    # and one from an engine that restarted (its counter back at 0).
    await send(pub, publish_frames(b"kv", seq + 1, batch(7)))
    await send(pub, publish_frames(b"kv", 0, batch(8)))

    async def restarted() -> bool:
        return events.restarts == 1

    await wait_until(restarted)
    assert events.bad_messages == len(garbage)
    assert events.gaps == {"rebuilt": 1}
    assert index.match("gpu", block_hashes(range(800, 816))) == 1
    assert index.match("gpu", block_hashes(range(700, 716))) == 0  # before the restart


async def snapshot(client: httpx.AsyncClient, dashboard_url: str) -> dict[str, Any]:
    response = await client.get(dashboard_url + "/api/snapshot")
    result: dict[str, Any] = response.json()
    return result


def chat(system: int, question: int) -> dict[str, Any]:
    words = " ".join(f"rule{(system * 31 + i) % 97}" for i in range(200))
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"System {system}: {words}"},
            {"role": "user", "content": f"Question {question}?"},
        ],
        "max_tokens": 2,
    }


async def test_after_an_eviction_the_next_request_is_no_false_hit_and_metrics_show_it(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [
        await start_sim(tokenize_with="default", kv_events_endpoint=ANY_PORT, seed=i)
        for i in range(2)
    ]
    entries = []
    for sim in sims:
        assert sim.app.kv_publisher is not None
        entries.append(f"{sim.url}={sim.app.kv_publisher.endpoint}")
    running = await start_sluice([s.url for s in sims], forward="tokens", kv_events=tuple(entries))
    url = running.proxy_url + "/v1/chat/completions"
    subscribers = list(running.sluice.kv_subscribers.values())
    question = 0

    async def every_subscriber_heard() -> bool:
        nonlocal question
        question += 1
        response = await client.post(url, json=chat(100 + question, question))
        assert response.status_code == 200, response.text
        return all(s.events.batches for s in subscribers)

    await wait_until(every_subscriber_heard, timeout=20)

    first = await client.post(url, json=chat(1, 0))
    home = first.headers["x-sluice-backend"]
    subscriber = running.sluice.kv_subscribers[home]
    index = running.sluice.router.policy.index  # type: ignore[attr-defined]

    async def confirmed() -> bool:
        return subscriber.events.blocks["confirmed"] > 0

    await wait_until(confirmed)
    second = await client.post(url, json=chat(1, 1))
    assert (second.headers["x-sluice-backend"], second.headers["x-sluice-route"]) == (
        home,
        "cache_aware:prefix-hit",
    )

    sim = next(s for s in sims if s.url == home)
    assert (await client.post(sim.url + "/sim/evict")).status_code == 200
    backend_id = running.sluice.pool.find(home).id  # type: ignore[union-attr]

    async def learned_the_eviction() -> bool:
        return index.blocks(backend_id) == 0

    await wait_until(learned_the_eviction)
    third = await client.post(url, json=chat(1, 2))
    assert not (
        third.headers["x-sluice-backend"] == home
        and third.headers["x-sluice-route"] == "cache_aware:prefix-hit"
    )

    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert f'sluice_kv_events_applied_total{{backend="{home}",type="cleared"}} 1.0' in metrics
    assert f'sluice_kv_events_source{{backend="{home}",source="events"}} 1.0' in metrics
    assert "sluice_kv_events_lag_seconds" in metrics
    rows = {b["url"]: b for b in (await snapshot(client, running.dashboard_url))["backends"]}
    assert rows[home]["kv_events"]["source"] == "events"
    assert rows[home]["kv_events"]["events"]["cleared"] == 1


async def test_a_dead_endpoint_is_only_silence(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    with trio.socket.socket() as probe:  # a port nobody listens on
        await probe.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    running = await start_sluice([sim.url], kv_events=(f"{sim.url}={dead}",))
    url = running.proxy_url + "/v1/chat/completions"
    for question in range(3):
        assert (await client.post(url, json=chat(1, question))).status_code == 200
    (row,) = (await snapshot(client, running.dashboard_url))["backends"]
    assert row["kv_events"]["source"] == "predicted"
    assert row["kv_events"]["silence"] == "no event yet"


async def test_an_engine_whose_token_ids_are_not_sluices_is_said_to_be_unmatched(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    # Forwarded text, which the sim renders with its own stand-in template and splits into
    # words: none of the blocks it stores is one Sluice predicted.
    sim = await start_sim(kv_events_endpoint=ANY_PORT)
    assert sim.app.kv_publisher is not None
    running = await start_sluice(
        [sim.url], kv_events=(f"{sim.url}={sim.app.kv_publisher.endpoint}",)
    )
    url = running.proxy_url + "/v1/chat/completions"
    question = 0

    async def unmatched() -> bool:
        nonlocal question
        question += 1
        assert (await client.post(url, json=chat(question, question))).status_code == 200
        (row,) = (await snapshot(client, running.dashboard_url))["backends"]
        return row["kv_events"]["source"] == "predicted"

    await wait_until(unmatched, timeout=30)
    (row,) = (await snapshot(client, running.dashboard_url))["backends"]
    assert row["kv_events"]["silence"].startswith("unmatched: ")
    assert row["kv_events"]["blocks"].get("confirmed", 0) == 0
