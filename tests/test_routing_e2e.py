"""Routing end to end: a real Sluice in front of simulated backends on 127.0.0.1. cache_aware
follows shared system prompts and says so in `x-sluice-route`; its predictions are checked
against the backends' reported cached tokens, and a simulated eviction corrects the index;
consistent_hash keeps a session on one backend; backends are added and removed at run time
through the dashboard (admin-guarded) and a removed one gets no traffic; too many tokens per
minute or every backend at its in-flight limit yields 429 with Retry-After, and the wait
queue holds its bound."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import trio

from tests.conftest import StartSim, StartSluice, StartSluiceOnASim, wait_until

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def system_prompt(number: int, words: int = 300) -> str:
    return f"You are assistant number {number}. " + " ".join(
        WORDS[(number * 7 + i * 5) % len(WORDS)] for i in range(words)
    )


def chat(system: int, question: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system_prompt(system)},
            {"role": "user", "content": f"Question {question}: what now?"},
        ],
        "max_tokens": 2,
        **extra,
    }


async def post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], **kw: Any
) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", json=body, **kw)


async def snapshot(client: httpx.AsyncClient, dashboard_url: str) -> dict[str, Any]:
    response = await client.get(dashboard_url + "/api/snapshot")
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


async def test_cache_aware_follows_system_prompts_and_checks_its_predictions(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(seed=i) for i in range(3)]
    running = await start_sluice([s.url for s in sims])
    homes: dict[int, set[str]] = {}
    routes: Counter[str] = Counter()
    for question in range(4):
        for system in range(3):
            response = await post(client, running.proxy_url, chat(system, question))
            assert response.status_code == 200, response.text
            homes.setdefault(system, set()).add(response.headers["x-sluice-backend"])
            routes[response.headers["x-sluice-route"]] += 1
    assert all(len(backends) == 1 for backends in homes.values())
    assert routes == {"cache_aware:new-prefix": 3, "cache_aware:prefix-hit": 9}

    async def predictions_settled() -> bool:
        routing = (await snapshot(client, running.dashboard_url))["routing"]
        return bool(sum(routing["cache_aware"]["prediction"]["outcomes"].values()) == 12)

    await wait_until(predictions_settled)
    routing = (await snapshot(client, running.dashboard_url))["routing"]
    prediction = routing["cache_aware"]["prediction"]
    assert prediction["outcomes"]["hit"] == 9 and prediction["outcomes"]["miss"] == 3
    assert prediction["corrections"] == 0
    assert prediction["mean_reported_hit"] > 0.5
    assert routing["cache_aware"]["index"]["blocks"] > 0
    metrics = (await client.get(running.proxy_url + "/metrics")).text
    assert 'sluice_route_predictions_total{outcome="hit"} 9.0' in metrics
    assert 'sluice_route_decisions_total{policy="cache_aware",reason="prefix-hit"} 9.0' in metrics

    async def load_scraped() -> bool:
        backends = (await snapshot(client, running.dashboard_url))["backends"]
        return all(b["reported_kv_usage"] is not None for b in backends)

    await wait_until(load_scraped)


async def test_a_simulated_eviction_corrects_the_index(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim()
    running = await start_sluice([sim.url])
    for system in (1, 2):
        assert (await post(client, running.proxy_url, chat(system, 0))).status_code == 200
    (await client.post(sim.url + "/sim/evict")).raise_for_status()

    response = await post(client, running.proxy_url, chat(2, 1))
    assert response.headers["x-sluice-route"] == "cache_aware:prefix-hit"

    async def corrected() -> bool:
        routing = (await snapshot(client, running.dashboard_url))["routing"]
        return bool(routing["cache_aware"]["prediction"]["corrections"] == 1)

    await wait_until(corrected)
    prediction = (await snapshot(client, running.dashboard_url))["routing"]["cache_aware"][
        "prediction"
    ]
    assert prediction["outcomes"]["false-hit"] == 1 and prediction["corrected_blocks"] > 0
    # System prompt 1 was used before the evicted one: Sluice no longer believes it is there.
    response = await post(client, running.proxy_url, chat(1, 1))
    assert response.headers["x-sluice-route"] == "cache_aware:new-prefix"
    # System prompt 2 was just computed again: it is.
    response = await post(client, running.proxy_url, chat(2, 2))
    assert response.headers["x-sluice-route"] == "cache_aware:prefix-hit"


async def test_consistent_hash_keeps_sessions_together(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sims = [await start_sim(seed=i) for i in range(3)]
    running = await start_sluice([s.url for s in sims], policy="consistent_hash")
    placed: dict[str, set[str]] = {}
    for turn in range(3):
        for session in range(8):
            headers = {"x-session-id": f"session-{session}"}
            response = await post(client, running.proxy_url, chat(session, turn), headers=headers)
            assert response.headers["x-sluice-route"] == "consistent_hash:session"
            placed.setdefault(f"session-{session}", set()).add(response.headers["x-sluice-backend"])
    assert all(len(backends) == 1 for backends in placed.values())
    assert len(set().union(*placed.values())) >= 2
    by_user = await post(client, running.proxy_url, chat(0, 9, user="session-0"))
    assert {by_user.headers["x-sluice-backend"]} == placed["session-0"]


async def test_backends_join_and_leave_at_run_time(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    first, second = await start_sim(seed=1), await start_sim(seed=2)
    running = await start_sluice([first.url], admin_token="s3cret")
    api = running.dashboard_url + "/api/backends"
    auth = {"authorization": "Bearer s3cret"}

    assert (await client.post(api, json={"url": second.url})).status_code == 401
    cross_site = {**auth, "origin": "http://evil.example"}
    assert (await client.post(api, json={"url": second.url}, headers=cross_site)).status_code == 403
    for bad in ({"url": "https://x:1"}, {"url": "http://x:1/?q=1"}, {"url": 5}, [1]):
        response = await client.post(api, json=bad, headers=auth)
        assert response.status_code == 400 and response.json()["error"]["message"]
    response = await client.post(api, json={"url": second.url + "/"}, headers=auth)
    assert response.status_code == 201, response.text
    added = response.json()["backend"]
    assert added["healthy"] and added["takes_traffic"] and added["url"] == second.url
    assert (await client.post(api, json={"url": second.url}, headers=auth)).status_code == 409

    listing = (await client.get(api)).json()["backends"]
    first_id = next(b["id"] for b in listing if b["url"] == first.url)
    assert (await client.delete(f"{api}/{first_id}")).status_code == 401
    assert (await client.delete(f"{api}/b-nothing", headers=auth)).status_code == 404
    assert (await client.delete(f"{api}/{first_id}", headers=auth)).status_code == 200
    last = (await client.get(api)).json()["backends"][0]["id"]
    assert (await client.delete(f"{api}/{last}", headers=auth)).status_code == 409

    served = {
        (await post(client, running.proxy_url, chat(i, 0))).headers["x-sluice-backend"]
        for i in range(6)
    }
    assert served == {second.url}
    routing = (await snapshot(client, running.dashboard_url))["routing"]["cache_aware"]
    assert set(routing["index"]["by_backend"]) == {added["id"]}


async def test_too_many_tokens_per_minute_is_a_429(
    start_sluice_on_a_sim: StartSluiceOnASim, client: httpx.AsyncClient
) -> None:
    running = await start_sluice_on_a_sim(tokens_per_minute=1000)
    alice, bob = {"authorization": "Bearer alice"}, {"authorization": "Bearer bob"}
    assert (await post(client, running.proxy_url, chat(0, 0), headers=alice)).status_code == 200
    assert (await post(client, running.proxy_url, chat(0, 1), headers=alice)).status_code == 200
    refused = await post(client, running.proxy_url, chat(0, 2), headers=alice)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "tokens_per_minute"
    assert int(refused.headers["retry-after"]) >= 1
    assert (await post(client, running.proxy_url, chat(0, 3), headers=bob)).status_code == 200
    huge = {"model": "m", "messages": [{"role": "user", "content": "word " * 3000}]}
    too_large = await post(client, running.proxy_url, huge, headers=bob)
    assert too_large.json()["error"]["code"] == "request_too_large"


async def test_every_backend_at_its_ceiling_holds_then_refuses_and_the_bound_holds(
    start_sim: StartSim, start_sluice: StartSluice, client: httpx.AsyncClient
) -> None:
    sim = await start_sim(inter_token_latency=0.02)
    running = await start_sluice([sim.url], max_inflight_per_backend=2, admission_queue=2)
    statuses: list[int] = []
    most_running = 0

    async def one(number: int) -> None:
        response = await post(client, running.proxy_url, chat(number, 0, max_tokens=25))
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "queue_full"
            assert response.headers["retry-after"] == "1"

    async def watch_backend() -> None:
        nonlocal most_running
        while True:
            state = (await client.get(sim.url + "/sim/state")).json()
            most_running = max(most_running, state["running"] + state["waiting"])
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_backend)
        async with trio.open_nursery() as requests:
            for number in range(8):
                requests.start_soon(one, number)
        nursery.cancel_scope.cancel()
    assert sorted(statuses) == [200] * 4 + [429] * 4
    assert most_running <= 2
    snap = await snapshot(client, running.dashboard_url)
    assert snap["routing"]["admission"]["rejected"] == {"queue_full": 4}
    assert snap["routing"]["admission"]["held"] == 0
